"""What every rank has imported before the implementation loads: the forkserver imports these once
and forks each rank from it (harness/driver/world.py), and the autograder's import check imports
them before the submission, so that what it measures is what the submission adds to a rank."""

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "harness.rank.loop", "harness.rank.programs")

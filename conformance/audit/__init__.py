"""The communication audit: not what the ranks compute but what they send, checked against the
cost model of reference/cost_model.py (CS336 lecture 7: "how many bytes move?").

The ranks run in an audited world (WorldPool(audit=True)): each joins the process group through
the recording backend of harness/rank/recording.py and reports every call it made during a task, from
Python or from C++ (DDP's reducer, DTensor). The driver then applies the rules of harness/driver/audit.py:

* accounted for: on every audited task, each rank wrote (as the kernel counted it, read by the
  driver from /proc/<pid>/io) no more than its records explain plus transport overhead, so a call
  hidden from the in-rank recorder still shows (harness/driver/audit.py: accounted);
* point-to-point only: a collective of the implementation under test makes send/recv calls only.
  Required for every implementation except torch.distributed and adapters.* (which are torch's
  own collectives: backend collectives by definition), unless --audit-require-p2p says otherwise;
  where not required the test is skipped with what was observed, never failed;
* bytes within the bound: every rank sends at most the cost model's per-rank bound for the call
  (a backend collective is charged its bound), so a second all-reduce, a linear broadcast or an
  all-gather of whole tensors where a ring suffices is reported with the numbers;
* data parallelism: one step sends at most one all-reduce of the trainable gradients, and backend
  reductions add up to exactly the trainable gradient bytes (none twice, no frozen parameter);
* sharded optimizer (ZeRO stage 1): backward sends nothing, and a step sends no more than a
  reduce-scatter and an all-gather of balanced shards, data parallelism's volume;
* expert parallelism: only tokens whose expert lives elsewhere travel, and their results come
  back (plus the per-expert counts), the same bytes again backward;
* tensor parallelism: the MLP moves one all-reduce's bytes of the activation forward and one
  backward (with sequence parallelism as an all-gather and a reduce-scatter each, plus backward the
  all-reduce of the row bias gradient), the column layer without gather_output sends nothing forward, and no backend all-gather of the full
  hidden activation is made.

The data-parallel and tensor-parallel audits need the implementation's DataParallel /
TensorParallelMLP / ColumnParallelLinear; without them they are skipped (their absence is graded by
the data_parallel and tensor_parallel capabilities).
"""

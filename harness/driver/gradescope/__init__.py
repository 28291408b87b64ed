"""Grading on Gradescope (or a platform like it): the autograder zip (build), what its
run_autograder does (run), the submission's check before any rank starts (precheck), the
platform's limits read from inside the container (limits), and an emulation of its container on
a machine without Docker (container), for the project's own tests and the tier benchmark."""

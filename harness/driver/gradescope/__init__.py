"""Grading on Gradescope (or a platform like it): the autograder zip (build) and the course's
choices it carries (config), what its run_autograder does (run), the submission's check before any
rank starts (precheck), the platform's limits read from inside the container (limits), an emulation
of its container on a machine without Docker (container), the autograder tried in that emulation
(trial: tests/test_autograder.py and the tier benchmark), and the examples the grading profile draws
(draws: the autograder's and a student's checkout must draw the same)."""

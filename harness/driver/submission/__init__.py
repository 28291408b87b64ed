"""The submission read by the driver, before any rank starts (issue 58, item 3): its own files parsed
(never imported, never run), every reach into the grader reported, and what it takes from the suite's
bundled implementations found. The verdicts are the plugin's (harness/driver/plugin/submission.py).

* files.py: which files are the submission's own (the --impl file or module, a CS336 repository);
* reaches.py: the reaches into the grader in a file (the suite's modules, sys.modules, gc, ctypes,
  importlib, builtins, exec/eval/compile/__import__, writes on imported modules);
* bundled.py: the suite's bundled implementations (impls/, adapters/) as data: their names, and
  every function's body normalised, for copies;
* taken.py: what a submission takes from them (imported and not replaced, wrapped, or copied), by
  capability;
* reading.py: the three put together, once per session.
"""

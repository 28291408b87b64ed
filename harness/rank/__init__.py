"""The rank side: everything that runs inside a rank process, next to the implementation under test.

The rank loop (loop.py), loading the implementation (loader.py), what a rank program may ask of it
(context.py), the rank programs (programs/), the models they build (models.py, pipeline_models.py),
the communication recorder (recording.py) and flight recorder (flight_recorder.py), the wire to the
driver (wire.py) and the rank's user of its own (containment.py).

Whatever is here runs where the code under test can read and rewrite it, so nothing here decides a
verdict: it never imports ``harness.driver``, ``reference``, ``conformance`` or the grading code
(tests/test_layering.py walks its imports). The driver may import it for shared formats and models.
"""

"""The offline tools (numpy and pandas; torch only to replay ops).  Their public entry points are
``dispatchprobe.compare(a, b, out=...)`` (:func:`.compare.compare`) and
``dispatchprobe.run_ut(records, out_dir, ...)`` (:func:`.run_ut.run_ut`)."""

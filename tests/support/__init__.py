"""What the tests share: running the ``hypertron`` command in process (:mod:`.cli`) or as processes
(:mod:`.processes`), comparing directories before and after (:mod:`.snapshots`), and producing a
thing once for every pytest-xdist worker (:mod:`.shared`)."""

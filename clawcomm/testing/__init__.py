"""The test harness, shipped so that tests/ and bench/ share it; not part of
the API, and nothing in the package's runtime imports it (tests/test_house.py
checks that). The launcher the tests start ranks with is
:mod:`clawcomm.launch`.

- :mod:`clawcomm.testing.chaos`: the chaos families (kill, mismatch,
  settings, timeout, soak, storm) and their scores.
- :mod:`clawcomm.testing.stores`: a ``TCPStore`` the test process serves,
  for tests that kill ranks mid-setup (a ``FileStore`` hangs its readers
  when a writer dies mid-record).
- :mod:`clawcomm.testing.frames`: wire frames and their fuzzer.
- :mod:`clawcomm.testing.checkpoint`: a trainer killed while it saves.
"""

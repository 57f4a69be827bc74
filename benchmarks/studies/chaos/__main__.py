"""``python -m benchmarks.studies.chaos --recompute PREFIX_raw.tar.xz`` (:func:`report.main`)."""
from benchmarks.studies.chaos import report

report.main()

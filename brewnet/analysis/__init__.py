"""Looking at nets and runs: per-layer timing (``timing``), shapes/params/FLOPs (``summary``),
Caffe-format log lines (``glog``) and reading such logs back (``logparse``)."""

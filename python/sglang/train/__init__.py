"""Training-side code: the plain-PyTorch reference BailingMoeV3 (``sglang.train.reference``)."""

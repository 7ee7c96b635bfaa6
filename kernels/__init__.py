"""Faster engines for the plain model in model/, each beside a plain-PyTorch reference;
train/engines.py picks the ones a model is built with (see kernels/README.md). model/ never
imports from here."""

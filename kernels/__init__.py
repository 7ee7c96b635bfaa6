"""Faster engines for the plain model in model/, each beside a plain-PyTorch reference, swapped in by
kernels/swap.py (see kernels/README.md). model/ never imports from here."""

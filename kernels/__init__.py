"""Kernels: one public function per op, each with a pure-torch reference (``*_ref`` / the
``reference`` module functions) and, where written, Triton implementations chosen by
``kernels.dispatch``. This package imports only torch and triton."""

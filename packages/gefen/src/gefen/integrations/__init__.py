"""Integrations of the meta-package's optimizers with other tools.

* :mod:`gefen.integrations.conformance`: conformance-kit factories for ``GefenMuonHybrid``
  (``gefen conformance gefen.integrations.conformance:hybrid_factory``).

Hugging Face ``Trainer`` needs no adapter: pass ``optimizer_cls_and_kwargs=(Gefen, {...})``
or ``optimizers=(GefenMuonHybrid(model, lr=...), None)`` (see the package README).
"""

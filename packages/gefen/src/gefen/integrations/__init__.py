"""Integrations of the meta-package's optimizers with other tools.

* :mod:`gefen.integrations.conformance`: conformance-kit factories for ``GefenMuonHybrid``
  (``gefen conformance gefen.integrations.conformance:hybrid_factory``);
* :mod:`gefen.integrations.huggingface`: build a ``GefenMuonHybrid`` from a Hugging Face
  ``TrainingArguments`` for ``Trainer(optimizers=(optimizer, None))`` (transformers is not
  imported: the arguments object is read by attribute).
"""

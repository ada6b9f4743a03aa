"""Where users already work: pytest, PyTorch Lightning, Hugging Face Transformers, notebooks.

Each integration is its own module, imported only when used (none is imported by
``import cudamem``), and each needs only its own framework:

* ``cudamem.integrations.pytest_plugin`` — ``@pytest.mark.limit_gpu_leaks`` and
  ``@pytest.mark.limit_gpu_memory`` (the plugin is registered as ``pytest_cudamem``);
* ``cudamem.integrations.lightning`` — ``CudamemCallback``
  (``pip install 'cudamem[lightning]'``);
* ``cudamem.integrations.transformers`` — ``CudamemTrainerCallback`` and
  ``release_trainer`` (``pip install 'cudamem[transformers]'``);
* ``cudamem.integrations.notebook`` — ``%load_ext cudamem``: ``%%track``, ``%who_holds``.
"""

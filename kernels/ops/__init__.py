"""Pure kernels: functional forms with their own autograd where they have their own backward.

One module per kernel family (``attention``, ``bias_gelu``, ``dropout_add_layer_norm``, ``qkv``,
``softmax``, ``batch_norm_fold``); the public names are re-exported by ``adopter.kernels``.
``triton_*.py`` modules import triton and are loaded only when the triton backend is selected.
(Nothing is re-exported here: the function names equal their module names.)
"""

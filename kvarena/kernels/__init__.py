"""Triton kernels and their launchers (no policy, no validation beyond what a launch needs).

* ``paged_attention``: block-table gather attention (decode, chunked prefill, whole-chunk
  queries over slabs), GQA packed into one tile, split-KV with an LSE reduce
  (``split_reduce``); its key loops in ``attn_tiles``, per-tile math in ``attn_math``, the
  launch plan in ``attn_plan``, tiles per target in ``attn_configs``.
* ``store``: scatter of new K/V rows into the cache through a slot mapping.
* ``merge``: exact merge of two partial attentions by their log-sum-exp.

Nothing is imported here, so ``import kvarena.kernels`` never imports triton; the ops in
``kvarena.attention`` import the launcher modules when a Triton backend is chosen.
"""

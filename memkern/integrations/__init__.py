"""memkern inside other training frameworks.

``memkern.integrations.transformers``: :class:`~memkern.integrations.transformers.MemkernTrainer`,
a drop-in ``transformers.Trainer`` that trains with memkern's layers and ``ShardedOptimizer``
(or FSDP2 and ``FusedAdamW``). ``memkern.integrations.fsdp2``: the FSDP2 unit layout it and the
planner use. ``memkern.integrations.mmengine``: ``MemkernOptimWrapper``, ``MemkernPatchHook`` and
``MemkernDataParallel`` in MMEngine's registries. Imported on demand: memkern itself needs
neither ``transformers`` nor ``mmengine``.
"""

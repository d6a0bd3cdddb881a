"""memkern inside other training frameworks.

``memkern.integrations.transformers``: :class:`~memkern.integrations.transformers.MemkernTrainer`,
a drop-in ``transformers.Trainer`` that trains with memkern's layers and ``ShardedOptimizer``.
Imported on demand: memkern itself does not need ``transformers``.
"""

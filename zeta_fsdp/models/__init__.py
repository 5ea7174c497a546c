"""Small models shipped with the package: the demo, the planner's examples and the docs use them.

Example:
    >>> from zeta_fsdp.models.gpt import Block, small
    >>> isinstance(small().blocks[0], Block)
    True
"""

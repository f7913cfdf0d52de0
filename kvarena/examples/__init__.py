"""Small example models that call kvarena inside their forward pass.

They live in the package (not only in ``examples/``) so that ``kvarena demo`` works from
any install; the scripts in the repository's ``examples/`` folder just call them.
"""

"""``python -m padfree_plugins``: the ``padfree-plugins`` command line, e.g. under a launcher that runs modules
(``torchrun --nproc_per_node 2 -m padfree_plugins train ...``)."""

from padfree_plugins.cli import main

if __name__ == "__main__":
    main()

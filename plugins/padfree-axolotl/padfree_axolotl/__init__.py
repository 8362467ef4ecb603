"""padfree-plugins for axolotl: ``axolotl train config.yml`` padding-free when the config has a ``padfree:`` key.

* :mod:`.config`: what the ``padfree:`` key holds (the acceleration config inline, or the path of its YAML file) and
  what is refused beside it (axolotl's own ``sample_packing`` / ``batch_flattening``); no axolotl import.
* :mod:`.plugin`: the axolotl plugin (entry-point group ``axolotl.plugins``): the key in axolotl's config schema, and
  ``post_trainer_create`` → :func:`padfree_plugins.accelerate`.
* :mod:`.trainer`: the padfree-plugins trainer plugin for axolotl's ``AxolotlTrainer`` (its packed path, its eval
  collator); axolotl's DPO / KTO / GRPO trainers are TRL's and take padfree-plugins' TRL plugins.
"""

__version__ = "0.1.0"

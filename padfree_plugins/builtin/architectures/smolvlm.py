"""SmolVLM (image-text): as Idefics3 (:mod:`.idefics3`) — sub-image tiles, ``image_seq_len`` tokens each, the
tiles of the packed row given to the model as ``[1, all tiles, 3, S, S]``. (SmolVLM keeps one all-zero tile when
every tile is zero, where Idefics3 drops them all; a packed row has none.)"""

from padfree_plugins.builtin.architectures.idefics3 import family

SMOLVLM = family("smolvlm", "SmolVLM image-text models (sub-image tiles, per-tile SigLIP vision tower)")
register_architectures, patch_model = SMOLVLM.hooks()

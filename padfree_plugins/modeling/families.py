"""The shared shape of a family declared once in code (:class:`~padfree_plugins.modeling.hybrids.Hybrid`,
:class:`~padfree_plugins.modeling.vision.VisionLanguage`): its plugin module's hooks come from :meth:`hooks`."""

from __future__ import annotations

from typing import Any

from padfree_plugins.contract.hookspecs import hookimpl


class DeclaredFamily:
    """A family with an ``architecture`` and a ``patch(model, backend, fallback, config)`` of its own."""

    architecture: Any

    def patch(self, model: Any, backend: Any, fallback: Any, config: Any) -> Any:
        raise NotImplementedError

    def hooks(self) -> tuple[Any, Any]:
        """The module-level hooks of the family's plugin: ``register_architectures, patch_model = FAMILY.hooks()``."""

        @hookimpl
        def register_architectures():
            return [self.architecture]

        @hookimpl
        def patch_model(model, architecture, backend, fallback, config):
            if architecture.name != self.architecture.name:
                return None
            return self.patch(model, backend, fallback, config)

        return register_architectures, patch_model

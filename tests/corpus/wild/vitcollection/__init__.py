"""A small vision-transformer collection laid out as a package (written for this corpus, in the
style of timm-like model zoos): layers in one module, models in another, a name registry."""
from .vision_transformer import (
    VisionTransformer,
    vit_cross_tiny,
    vit_hybrid_tiny,
    vit_sepqkv_tiny,
    vit_tiny_patch4,
)

_ENTRYPOINTS = {
    "vit_tiny_patch4": vit_tiny_patch4,
    "vit_hybrid_tiny": vit_hybrid_tiny,
    "vit_sepqkv_tiny": vit_sepqkv_tiny,
    "vit_cross_tiny": vit_cross_tiny,
}


def create_model(name, **kwargs):
    return _ENTRYPOINTS[name](**kwargs)


__all__ = ["VisionTransformer", "create_model"]

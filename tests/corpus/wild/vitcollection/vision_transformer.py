"""Vision transformers of the collection: the plain ViT, a hybrid with a convolutional stem,
a variant with separate q/k/v projections, and one whose class token attends to the patches
(cross-attention), plus a batch-norm classifier head. Layers come from the sibling module."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .layers import Attention, DropPath, LayerScale, Mlp, PatchEmbed, create_conv2d, create_linear


class SeparateQKVAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=True, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        q = self.q_proj(x).reshape(B, N, self.num_heads, -1).permute(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, N, self.num_heads, -1).permute(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, N, self.num_heads, -1).permute(0, 2, 1, 3)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class ClassTokenCrossAttention(nn.Module):
    """The class token (query) attends to all tokens (keys and values)."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        self.wq = nn.Linear(dim, dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        q = self.wq(x[:, 0:1, ...]).reshape(B, 1, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        k = self.wk(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        v = self.wv(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, 1, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, proj_drop=0.0, attn_drop=0.0,
                 init_values=None, drop_path=0.0, act_layer=nn.GELU, norm_layer=nn.LayerNorm,
                 attn_layer=Attention):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = attn_layer(dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                               proj_drop=proj_drop)
        self.ls1 = LayerScale(dim, init_values=init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.ls2 = LayerScale(dim, init_values=init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


class ClassTokenBlock(nn.Module):
    """CaiT-style class-attention block: only the class token is updated."""

    def __init__(self, dim, num_heads, mlp_ratio=4.0, norm_layer=nn.LayerNorm):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = ClassTokenCrossAttention(dim, num_heads=num_heads)
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio))

    def forward(self, x):
        cls_token = x[:, :1] + self.attn(self.norm1(x))
        cls_token = cls_token + self.mlp(self.norm2(cls_token))
        return torch.cat([cls_token, x[:, 1:]], dim=1)


class ConvStem(nn.Module):
    """Two stride-2 conv/BN/ReLU stages and a 1x1 projection: a hybrid ViT's patch embedding."""

    def __init__(self, img_size=32, patch_size=4, in_chans=3, embed_dim=64, norm_layer=None):
        super().__init__()
        assert patch_size == 4
        mid = embed_dim // 4
        self.num_patches = (img_size // patch_size) ** 2
        self.conv1 = create_conv2d(in_chans, mid, 3, stride=2)
        self.bn1 = nn.BatchNorm2d(mid)
        self.act1 = nn.ReLU(inplace=True)
        self.conv2 = create_conv2d(mid, mid * 2, 3, stride=2)
        self.bn2 = nn.BatchNorm2d(mid * 2)
        self.act2 = nn.ReLU(inplace=True)
        self.proj = create_conv2d(mid * 2, embed_dim, 1, bias=True)

    def forward(self, x):
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.conv2(x)
        x = self.bn2(x)
        x = self.act2(x)
        x = self.proj(x)
        return x.flatten(2).transpose(1, 2)


class SequentialConvStem(nn.Module):
    """The same stem as one nn.Sequential grown in a loop."""

    def __init__(self, img_size=32, patch_size=4, in_chans=3, embed_dim=64, norm_layer=None):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        layers = []
        chs = in_chans
        for out_chs in (embed_dim // 4, embed_dim // 2):
            layers.append(create_conv2d(chs, out_chs, 3, stride=2))
            layers.append(nn.BatchNorm2d(out_chs))
            layers.append(nn.ReLU(inplace=True))
            chs = out_chs
        layers.append(create_conv2d(chs, embed_dim, 1, bias=True))
        self.stem = nn.Sequential(*layers)

    def forward(self, x):
        return self.stem(x).flatten(2).transpose(1, 2)


class BatchNormHead(nn.Module):
    def __init__(self, in_features, hidden_features, num_classes, drop=0.0):
        super().__init__()
        self.fc = create_linear(in_features, hidden_features)
        self.bn = nn.BatchNorm1d(hidden_features)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(drop)
        self.out = nn.Linear(hidden_features, num_classes)

    def forward(self, x):
        x = self.act(self.bn(self.fc(x)))
        return self.out(self.drop(x))


class ProjectionHead(nn.Module):
    """A self-supervised projection head: Linear/BN/GELU twice, then a bias-free output Linear."""

    def __init__(self, in_dim, out_dim, hidden_dim=128, bottleneck_dim=32):
        super().__init__()
        self.mlp = nn.Sequential(
            create_linear(in_dim, hidden_dim),
            nn.BatchNorm1d(hidden_dim),
            nn.GELU(),
            create_linear(hidden_dim, bottleneck_dim),
            nn.BatchNorm1d(bottleneck_dim),
        )
        self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)

    def forward(self, x):
        x = self.mlp(x)
        x = nn.functional.normalize(x, dim=-1, p=2)
        return self.last_layer(x)


class VisionTransformer(nn.Module):
    def __init__(self, img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=64, depth=2,
                 num_heads=4, mlp_ratio=4.0, qkv_bias=True, drop_rate=0.0, attn_drop_rate=0.0,
                 drop_path_rate=0.0, init_values=None, embed_layer=PatchEmbed, attn_layer=Attention,
                 norm_layer=None, act_layer=None, class_attn_depth=0, bn_head=False, proj_head=False):
        super().__init__()
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        act_layer = act_layer or nn.GELU
        self.num_classes = num_classes
        self.num_features = self.embed_dim = embed_dim
        self.patch_embed = embed_layer(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                       embed_dim=embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, embed_dim) * 0.02)
        self.pos_drop = nn.Dropout(p=drop_rate)
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.Sequential(*[
            Block(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                  proj_drop=drop_rate, attn_drop=attn_drop_rate, init_values=init_values, drop_path=dpr[i],
                  norm_layer=norm_layer, act_layer=act_layer, attn_layer=attn_layer)
            for i in range(depth)])
        self.class_blocks = nn.ModuleList([
            ClassTokenBlock(embed_dim, num_heads, mlp_ratio, norm_layer=norm_layer)
            for _ in range(class_attn_depth)])
        self.norm = norm_layer(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        if proj_head:
            self.head = ProjectionHead(embed_dim, num_classes)
        elif bn_head:
            self.head = BatchNormHead(embed_dim, embed_dim * 2, num_classes, drop=drop_rate)
        else:
            self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x):
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.pos_drop(x + self.pos_embed)
        x = self.blocks(x)
        for blk in self.class_blocks:
            x = blk(x)
        return self.norm(x)

    def forward_head(self, x):
        x = x[:, 0]
        x = self.head_drop(x)
        return self.head(x)

    def forward(self, x):
        x = self.forward_features(x)
        return self.forward_head(x)


def vit_tiny_patch4(**kwargs):
    return VisionTransformer(**kwargs)


def vit_hybrid_tiny(**kwargs):
    return VisionTransformer(embed_layer=ConvStem, bn_head=True, **kwargs)


def vit_sepqkv_tiny(**kwargs):
    return VisionTransformer(embed_layer=SequentialConvStem, attn_layer=SeparateQKVAttention, init_values=1e-5,
                             drop_path_rate=0.1, proj_head=True, **kwargs)


def vit_cross_tiny(**kwargs):
    return VisionTransformer(class_attn_depth=1, **kwargs)

"""TASO's six benchmark models, built with the graph-builder API (issue 5, part 1).

Configurations follow TASO's evaluation (Jia et al., SOSP 2019, Section 7.1): ResNet-50,
NasNet-A, ResNeXt-50, NasRNN, BERT-Large and Inception-v3. Weights are random (seeded) and
marked as weights; layouts are NCHW activations and OIHW kernels.

Each module has ``build(**config) -> taso_jax.Graph`` (full size by default) and ``SMALL``,
a configuration with the same structure and small shapes, for tests on the CPU.
"""

from __future__ import annotations

from . import bert_large, inception_v3, nasnet_a, nasrnn, resnet50, resnext50

#: name -> module with ``build`` and ``SMALL``
MODELS = {"resnet50": resnet50, "nasnet_a": nasnet_a, "resnext50": resnext50,
          "nasrnn": nasrnn, "bert_large": bert_large, "inception_v3": inception_v3}

__all__ = ["MODELS"]

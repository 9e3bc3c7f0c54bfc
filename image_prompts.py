"""Image prompts as the model sees them: the image processor and token, and what a prompt becomes.

A chat prompt holds one <|image_pad|> per image; the engine (vLLM) and the trainer both replace it
by one token per merged 2x2 patch of the resized image, and the model puts the vision tower's
outputs there (docs/data.md, Images).
"""
import itertools
import json
import os
from dataclasses import dataclass


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # Qwen2-VL's


def is_vision_language(model_dir: str) -> bool:
    with open(os.path.join(model_dir, "config.json")) as f:
        return "vision_config" in json.load(f)


@dataclass
class ImageInputs:
    """What a vision-language forward takes besides the text: the ids with every image's
    placeholder expanded, and the processed images."""
    input_ids: list[int]
    pixel_values: "torch.Tensor"  # [patches, channels * temporal_patch * patch * patch]
    image_grid_thw: "torch.Tensor"  # [images, 3] patches along time, height, width
    mm_token_type_ids: list[int]  # 1 at image tokens; Qwen2.5-VL's 3-D rope positions need it


class ImagePrompts:
    """The model directory's image processor and image token; a prompt becomes the same pixels and
    ids the engine sees (vllm_plugins/no_torchvision.py)."""

    def __init__(self, model_dir: str):
        from transformers import AutoImageProcessor
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        if "image_token_id" not in config:
            raise ValueError(f"{model_dir}: not a vision-language model (config.json has no image_token_id)")
        self.image_token_id = config["image_token_id"]
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.merge = self.processor.merge_size

    def tokens_per_image(self, image) -> int:
        return self.processor.get_number_of_image_patches(image.height, image.width) // self.merge ** 2

    def expand(self, ids: list[int], images: list) -> tuple[list[int], list[int]]:
        """(ids with each picture's one placeholder token repeated once per merged patch
        group, 1 at those tokens else 0). The pictures' tokens are the first len(images) runs
        of image tokens: ids already expanded (the engine's) come back unchanged. Image tokens
        after them are text the model generated (vLLM embeds them as text, and so does
        the trainer: run.CausalLM). A run of another length is an error."""
        sizes, runs, i = [self.tokens_per_image(im) for im in images], [], 0
        for token, group in itertools.groupby(ids):
            n = len(list(group))
            if token == self.image_token_id:
                runs.append((i, i + n))
            i += n
        runs = runs[:len(images)]
        lengths = [j - i for i, j in runs]
        if lengths == sizes or lengths == [1] * len(images):
            out, mask, start = [], [], 0
            for (i, j), size in zip(runs, sizes):
                out += list(ids[start:i]) + [self.image_token_id] * size
                mask += [0] * (i - start) + [1] * size
                start = j
            return out + list(ids[start:]), mask + [0] * (len(ids) - start)
        raise ValueError(f"a sequence's image tokens come in runs of {lengths}, but its {len(images)} pictures need "
                         f"runs of 1 (one placeholder each) or of {sizes} (expanded)")

    def blank(self) -> tuple:
        """([1, L] image mask, [[picture]]): a black square of the smallest size the
        processor keeps, for forwards that must run the vision tower."""
        from PIL import Image
        side = self.processor.patch_size * self.merge
        picture = Image.new("RGB", (side, side))
        return [self.expand([self.image_token_id], [picture])[1]], [[picture]]

    def pixel_inputs(self, image_mask, images: list) -> dict:
        """Pixel values [patches, C*T*P*P] and grids [pictures, 3] of every sequence's pictures,
        concatenated in row order: the order of the masked tokens in the flattened batch, which
        is where they go. image_mask [B, L]: 1 at the pictures' tokens."""
        import torch
        flat = [im for row in images for im in row]
        expected = sum(self.tokens_per_image(im) for im in flat)
        found = int(torch.as_tensor(image_mask).sum())
        if found != expected:
            raise ValueError(f"the batch has {found} picture tokens, its pictures need {expected}")
        unique = {id(im): im for im in flat}  # a prompt's samples share its picture objects: process each once
        features = self.processor(images=list(unique.values()), return_tensors="pt")
        chunks = features["pixel_values"].split(features["image_grid_thw"].prod(-1).tolist())
        index = {key: i for i, key in enumerate(unique)}
        order = [index[id(im)] for im in flat]
        return {"pixel_values": torch.cat([chunks[i] for i in order]), "image_grid_thw": features["image_grid_thw"][order]}

    def __call__(self, prompt_ids: list[int], images: list) -> ImageInputs:
        """prompt_ids hold one image token per image, in the order of images."""
        count = sum(t == self.image_token_id for t in prompt_ids)
        if count != len(images):
            raise ValueError(f"the prompt has {count} image tokens but {len(images)} images were given")
        ids, mask = self.expand(prompt_ids, images)
        if not images:
            import torch
            return ImageInputs(ids, torch.zeros(0), torch.zeros(0, 3, dtype=torch.long), mask)
        inputs = self.pixel_inputs([mask], [images])
        return ImageInputs(ids, inputs["pixel_values"], inputs["image_grid_thw"], mask)


def draw_shapes(shapes: list[dict], size: int, grid: int):
    """The picture of a scene: each shape {"kind", "colour", "cell", "scale", "dx", "dy"} drawn in
    its grid cell on a white background (PIL, RGB): the picture task's (tasks/shapes.py), and the
    weight sync's probe of a vision-language model (sync.image_probe)."""
    from PIL import Image, ImageDraw
    image = Image.new("RGB", (size, size), "white")
    draw, cell = ImageDraw.Draw(image), size / grid
    for s in shapes:
        r, c = divmod(s["cell"], grid)
        half = cell * s["scale"] / 2
        cx, cy = (c + 0.5 + s["dx"]) * cell, (r + 0.5 + s["dy"]) * cell
        box = [cx - half, cy - half, cx + half, cy + half]
        if s["kind"] == "circle":
            draw.ellipse(box, fill=s["colour"])
        elif s["kind"] == "square":
            draw.rectangle(box, fill=s["colour"])
        else:
            draw.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=s["colour"])
    return image

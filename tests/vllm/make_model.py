#!/usr/bin/env python3
"""Makes a tiny Qwen2.5-VL model that vLLM serves, from nothing.

    python tests/vllm/make_model.py DIR [--poison] [--seed N]
        [--hidden N --layers N --max-pixels N]

DIR gets what `vllm ... --model DIR` reads: config.json (Qwen2.5-VL's
architecture at toy sizes: text hidden 128, 2 layers; vision depth 2,
hidden 64), a byte-level BPE tokenizer trained here on a few lines of
text, with Qwen's special tokens and a Qwen-style chat template, the
image processor's config, and float32 random weights as safetensors
(about 0.8 M parameters, 3.2 MB). Nothing is downloaded.

--hidden, --layers and --max-pixels make a larger variant of the same
model, whose image embeddings are the size a real model's are:
bench/vllm_epd.py's "mib" model is --hidden 1024 --layers 1 --max-pixels
1003520 (a 1280x720 image: 1,196 tokens x 1,024 float32, 4.9 MB).

The weights are drawn with a standard deviation of 0.2: at 0.05 greedy
outputs were nearly the same whatever the image, at 0.2 each image gives
its own tokens, which is what a test of encoder outputs needs.

--poison makes the same model with the vision merger's weights negated
(`visual.merger.*`): an encoder that serves it hands out wrong embeddings
of the right shape, the negative control of tests/vllm/. The seed is the
same, so everything else is equal.

vLLM keys encoder outputs by a hash that includes the --model string, so
an encoder and a prefill instance must be given the same string: serve a
poisoned copy under the same name from another working directory.
"""

import argparse
import json
import os
import sys

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# A chat template in Qwen's form: each message between <|im_start|>ROLE
# and <|im_end|>, an image as <|vision_start|><|image_pad|><|vision_end|>
# (vLLM widens the pad to the image's tokens), a system line first.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

CORPUS = [
    "Describe this image in one sentence.",
    "What is in the picture? A cat, a dog, a red square, a blue circle.",
    "The quick brown fox jumps over the lazy dog.",
    "There are three apples and two oranges on the table.",
    "An encoder turns an image into embeddings; the prefill reads them.",
    "Colors: red green blue yellow black white purple orange gray.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
    "You are a helpful assistant. Answer the question about the image.",
]


def make_tokenizer(out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:],
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # vLLM and transformers pick the processor's tokenizer by this class.
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg["chat_template"] = CHAT_TEMPLATE
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return {t: tok.token_to_id(t) for t in SPECIAL}, tok.get_vocab_size()


def make_config(ids, vocab, hidden=128, layers=2):
    from transformers import Qwen2_5_VLConfig

    # Room for the vocabulary, rounded up.
    vocab_size = (vocab + 63) // 64 * 64
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers,
            # head 32: mrope sections (temporal, height, width) add to 16.
            "num_attention_heads": hidden // 32,
            "num_key_value_heads": 2,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6,
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6],
                             "rope_theta": 10000.0},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "tie_word_embeddings": False,
            "dtype": "float32",
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "out_hidden_size": hidden,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )


def write_processor(out, max_pixels=448 * 448):
    image = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        # At most 448 x 448 (256 tokens an image) unless told, at least
        # 56 x 56.
        "min_pixels": 56 * 56,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": 56 * 56, "longest_edge": max_pixels},
    }
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(image, f, indent=2)
    video = dict(image, video_processor_type="Qwen2VLVideoProcessor")
    del video["image_processor_type"]
    with open(os.path.join(out, "video_preprocessor_config.json"), "w") as f:
        json.dump(video, f, indent=2)
    with open(os.path.join(out, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen2_5_VLProcessor"}, f, indent=2)


def main():
    ap = argparse.ArgumentParser(
        description="Make a tiny Qwen2.5-VL model (random weights, local "
        "tokenizer) in DIR for vLLM's tests; nothing is downloaded.")
    ap.add_argument("dir", help="folder to write (made if missing)")
    ap.add_argument("--poison", action="store_true",
                    help="negate the vision merger's weights (negative "
                    "control: wrong embeddings, right shape)")
    ap.add_argument("--seed", type=int, default=20261205)
    ap.add_argument("--std", type=float, default=0.2,
                    help="standard deviation of the random weights")
    ap.add_argument("--hidden", type=int, default=128,
                    help="text hidden size, also each image token's width "
                    "(a multiple of 32; default 128)")
    ap.add_argument("--layers", type=int, default=2,
                    help="text decoder layers (default 2)")
    ap.add_argument("--max-pixels", type=int, default=448 * 448,
                    help="the image processor's largest image, in pixels "
                    "(default 448 x 448)")
    args = ap.parse_args()
    if args.hidden < 64 or args.hidden % 32:
        ap.error("--hidden is a multiple of 32, at least 64, not %d" %
                 args.hidden)

    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    out = args.dir
    os.makedirs(out, exist_ok=True)
    ids, vocab = make_tokenizer(out)
    config = make_config(ids, vocab, args.hidden, args.layers)
    torch.manual_seed(args.seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    merger = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "norm" in name.split(".")[-2]:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.normal_(0.0, args.std / 4)
            else:
                p.normal_(0.0, args.std)
            if args.poison and ".merger." in name:
                p.neg_()
                merger += 1
    if args.poison and merger == 0:
        sys.exit("make_model: no visual.merger weights to negate")
    model.config.dtype = "float32"
    model.save_pretrained(out, safe_serialization=True)
    config.save_pretrained(out)
    write_processor(out, args.max_pixels)
    n = sum(p.numel() for p in model.parameters())
    print("make_model: %s: %.2f M parameters%s" %
          (out, n / 1e6, ", merger negated" if args.poison else ""))


if __name__ == "__main__":
    main()

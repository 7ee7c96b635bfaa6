"""Export a checkpoint as one GGUF file that llama.cpp loads (llama-cli, llama-server, llama-cpp-python, ollama).

    python scripts/export_gguf.py --ckpt checkpoints/pretrain --out exports/minimind-moe.gguf [--dtype float16]
    llama-cli -m exports/minimind-moe.gguf -p "Return the number of" -n 32 --temp 0

MoE checkpoints become llama.cpp's `qwen3moe` architecture, dense ones `qwen3`: the blocks of the HF export
(scripts/export_hf.py; the same refusals, the routed scaling folded into the experts' down projections). Tensor
names and metadata keys are gguf-py's (the `gguf` package). The tokenizer goes in as llama.cpp's byte-level BPE
("gpt2": tokens, merges, the three special tokens as control tokens, ids past the tokenizer's as unused ones)
with the GPT-2 pre-tokenizer, the split ours uses (data/tokenizer.py: `tokenizers`' ByteLevel and its GPT-2
regex), so llama.cpp encodes text to our ids (scripts/test_export.py checks it); the ChatML template; no BOS.
Norms and the router stay fp32 (as llama.cpp's converter keeps them), --dtype sets the other weights. The file is
written under a temporary name and renamed when complete; an existing --out is replaced only with --force.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from data.atomic import atomic_file  # noqa: E402
from model.hf_adapter import ExportError, check_exportable, down_proj_scale  # noqa: E402
from train.checkpoint import load_checkpoint, model_from_checkpoint  # noqa: E402
from train.flags import Parser, run_tool  # noqa: E402
from train.run_dir import run_tokenizer  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")


def tensors(model):
    """(GGUF tensor name, fp32 numpy array in PyTorch's [out, in] layout) of every weight, by gguf-py's names."""
    import gguf
    names, config = gguf.TENSOR_NAMES, model.config
    T = gguf.MODEL_TENSOR
    as_np = lambda t: t.detach().float().cpu().numpy()  # noqa: E731
    yield names[T.TOKEN_EMBD] + ".weight", as_np(model.model.embed_tokens.weight)
    yield names[T.OUTPUT_NORM] + ".weight", as_np(model.model.norm.weight)
    if not config.tie_word_embeddings:
        yield names[T.OUTPUT] + ".weight", as_np(model.lm_head.weight)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        parts = {T.ATTN_NORM: layer.input_layernorm.weight, T.ATTN_Q: attn.q_proj.weight,
                 T.ATTN_K: attn.k_proj.weight, T.ATTN_V: attn.v_proj.weight, T.ATTN_OUT: attn.o_proj.weight,
                 T.ATTN_Q_NORM: attn.q_norm.weight, T.ATTN_K_NORM: attn.k_norm.weight,
                 T.FFN_NORM: layer.post_attention_layernorm.weight}
        if config.use_moe:
            gate_EFD, up_EFD = mlp.experts.gate_up_proj.unflatten(1, (2, -1)).unbind(1)
            parts.update({T.FFN_GATE_INP: mlp.gate.weight, T.FFN_GATE_EXP: gate_EFD, T.FFN_UP_EXP: up_EFD,
                          T.FFN_DOWN_EXP: mlp.experts.down_proj * down_proj_scale(config)})
        else:
            parts.update({T.FFN_GATE: mlp.gate_proj.weight, T.FFN_UP: mlp.up_proj.weight,
                          T.FFN_DOWN: mlp.down_proj.weight})
        for kind, weight in parts.items():
            yield names[kind].format(bid=i) + ".weight", as_np(weight)


def vocabulary(tokenizer, vocab_size):
    """(tokens, token types, merges) as llama.cpp's "gpt2" vocabulary holds them, padded to the model's
    vocab_size with unused tokens."""
    import gguf
    special = set(tokenizer.all_special_ids)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.UNUSED] * (vocab_size - len(types))
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    return tokens, types, [m if isinstance(m, str) else " ".join(m) for m in merges]


def export_gguf(ckpt_path, out_path, dtype="float32", tokenizer_dir=None, force=False, log=print):
    """Write the GGUF file of a checkpoint (file, run folder or sharded run) at out_path. Raises ExportError for
    a model llama.cpp's qwen3 / qwen3moe cannot express or an --out that exists without `force`."""
    import gguf
    if os.path.isdir(out_path) or (os.path.exists(out_path) and not force):
        raise ExportError(f"{out_path}: " + ("is a folder; name a .gguf file" if os.path.isdir(out_path)
                                             else "exists; pass --force to replace it"))
    model = model_from_checkpoint(load_checkpoint(ckpt_path)).eval()
    config = model.config
    check_exportable(config)
    if config.use_moe and not config.norm_topk_prob:
        raise ExportError("cannot export: llama.cpp's qwen3moe renormalises the top-k router weights "
                          "(norm_topk_prob=False has no equivalent)")
    tokenizer, _ = run_tokenizer(ckpt_path, tokenizer_dir)
    if len(tokenizer) > config.vocab_size:
        raise ExportError(f"the tokenizer has {len(tokenizer)} tokens, the model only {config.vocab_size}")
    arch = "qwen3moe" if config.use_moe else "qwen3"
    with atomic_file(out_path, "wb") as tmp:  # (gguf-py writes to the temp file's path through its own handle)
        writer = gguf.GGUFWriter(tmp.name, arch)
        try:
            write_metadata(writer, config, tokenizer, dtype)
            for name, array in tensors(model):
                if array.ndim == 1 or name.endswith("ffn_gate_inp.weight") or dtype == "float32":
                    writer.add_tensor(name, array)
                elif dtype == "float16":
                    writer.add_tensor(name, array.astype(np.float16))
                else:
                    writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.BF16),
                                      raw_dtype=gguf.GGMLQuantizationType.BF16)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    log(f"exported {arch} ({dtype}) to {out_path}: {os.path.getsize(out_path) / 2**20:.1f} MiB")


def write_metadata(writer, config, tokenizer, dtype):
    """The architecture's hyperparameters, the file type and the tokenizer, as llama.cpp reads them."""
    import gguf
    writer.add_name("MiniMind-MoE" if config.use_moe else "MiniMind")
    writer.add_file_type({"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                          "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[dtype])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.use_moe:
        writer.add_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    else:
        writer.add_feed_forward_length(config.intermediate_size)
    tokens, types, merges = vocabulary(tokenizer, config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_add_bos_token(False)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for add, token_id in ((writer.add_eos_token_id, tokenizer.eos_token_id),
                          (writer.add_pad_token_id, tokenizer.pad_token_id), (writer.add_eot_token_id, end_of_turn)):
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:  # (a tokenizer may lack one)
            add(token_id)
    if tokenizer.chat_template:  # (the training-only {% generation %} marks out: plain ChatML for llama.cpp)
        writer.add_chat_template(tokenizer.chat_template.replace("{% generation %}", "")
                                 .replace("{% endgeneration %}", ""))


def main(argv=None):
    p = Parser(description=__doc__)
    p.add_argument("--ckpt", required=True, help="checkpoint file or run directory")
    p.add_argument("--out", required=True, help="the .gguf file to write (replaced only with --force)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the weights (norms, router: fp32)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: tokenizer/ next to the checkpoint)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    export_gguf(args.ckpt, args.out, args.dtype, args.tokenizer, args.force)


if __name__ == "__main__":
    run_tool(main)

"""Hugging Face Llama, Mixtral, Qwen3, Qwen3-MoE and Gemma 3 (text) checkpoints in and out: `jaxtrain import-hf` and
`jaxtrain export-hf`.

Import reads `config.json` and `*.safetensors` (one file, or shards with
`model.safetensors.index.json`) with `safetensors.numpy`: no torch, no pickles. It writes a
jaxtrain directory that `checkpoint.init_from` accepts:

    DIR/config.yaml          a full jaxtrain config whose `model` section matches the source and
                             whose `data.source` is null: training refuses until data is chosen
    DIR/checkpoints/0/       the parameters (fp32, jaxtrain's master dtype), committed
    DIR/hf_config.json       the source's config.json, so export can carry token ids and dtype
    DIR/tokenizer.json ...   tokenizer files copied from the source (data.tokenizer points here)

Export reads a run directory's `config.yaml` and a committed checkpoint's parameters and writes
`config.json` + `model.safetensors` (sharded with an index above `--max-shard-size`) that
`transformers.AutoModelForCausalLM.from_pretrained` loads, with the tokenizer the run's data was made
with (`AutoTokenizer` loads it) and its end-of-document id as bos/eos/pad in `config.json` and
`generation_config.json`.

Where things live: `mapping.py` (config fields and weight layout, pure functions), `files.py`
(safetensors, tokenizer files, output directories), `importer.py` and `exporter.py` (the two
commands, each with its `main(argv)` for the CLI). The layout table is in `mapping.py`; the
user guide is docs/hf.md.
"""

from jaxtrain.hf.exporter import export_hf
from jaxtrain.hf.importer import import_hf
from jaxtrain.hf.mapping import (hf_config_from_model, hf_model_type, hf_shapes, hf_tensors_from_params,
                                 model_section_from_hf, params_from_hf)

__all__ = ["export_hf", "hf_config_from_model", "hf_model_type", "hf_shapes", "hf_tensors_from_params", "import_hf",
           "model_section_from_hf", "params_from_hf"]

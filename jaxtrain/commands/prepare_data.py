"""`jaxtrain prepare-data --input PATH... --output DIR [...]`: the parser, `main` and the summary line;
`data/prepare.py` tokenizes and writes the files.
"""

from __future__ import annotations

from jaxtrain.commands.arguments import Parser
from jaxtrain.data.prepare import DEFAULT_SHARD_TOKENS, OUTPUT_FORMATS, prepare


def _parser() -> Parser:
    p = Parser(prog="jaxtrain prepare-data",
                                description="Tokenize .txt/.jsonl files into token files for data.source=tokens "
                                            "(or ArrayRecord files for data.source=arrayrecord).")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files, directories (their .txt and .jsonl files) or globs; a .jsonl line is a "
                        "document, any other file is one document")
    p.add_argument("--output", required=True, metavar="DIR",
                   help="directory for tokens-*.bin (or part-*.arrayrecord) and meta.json")
    p.add_argument("--output-format", choices=OUTPUT_FORMATS, default="tokens",
                   help="tokens: flat token files for data.source=tokens (default); arrayrecord: a record of uint32 "
                        "ids per document, for data.source=arrayrecord")
    p.add_argument("--tokenizer", default="bytes", help="'bytes' (default) or a Hugging Face tokenizers JSON file")
    p.add_argument("--dtype", choices=("uint16", "uint32"), default=None,
                   help="token file element type (default: uint16 when the vocabulary fits, else uint32)")
    p.add_argument("--eod-id", type=int, default=None,
                   help="end-of-document id (default: the tokenizer's end-of-text token; 256 for bytes)")
    p.add_argument("--text-field", default="text", help="field of each .jsonl line holding the text (default: text)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                   help=f"start a new file after this many tokens (default: {DEFAULT_SHARD_TOKENS})")
    p.add_argument("--overwrite", action="store_true", help="replace token files already in --output")
    return p


def main(argv: list[str]) -> int:
    """Entry point of `jaxtrain prepare-data` (argv without the subcommand).

    Returns:
      0 on success. Raises ConfigError for user errors and malformed flags (the CLI prints one
      line and exits 2).
    """
    args = _parser().parse_args(argv)  # malformed flags: ConfigError, exit 2
    s = prepare(args.input, args.output, tokenizer=args.tokenizer, dtype=args.dtype, eod_id=args.eod_id,
                text_field=args.text_field, shard_tokens=args.shard_tokens, overwrite=args.overwrite,
                output_format=args.output_format)
    skipped = f"; skipped {s['skipped_empty']} empty file(s)" if s["skipped_empty"] else ""
    print(f"prepare-data: wrote {s['num_tokens']:,} tokens ({s['num_documents']:,} documents from "
          f"{s['inputs']} input file(s)) to {args.output} in {len(s['files'])} {s['dtype']} file(s); "
          f"eod id {s['eod_id']}, vocab size {s['vocab_size']}, largest id {s['max_id']}{skipped}")
    return 0

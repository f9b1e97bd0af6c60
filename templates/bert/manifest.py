"""BERT's prepared data: its manifest format (lmkit/manifest.py's Manifest) and the files beside the shards,
`vocab.txt` and `tokenizer.json` (WordPiece, with BERT's special tokens)."""

FORMAT = "tpuctl-bert-mlm/1"
VOCAB_NAME = "vocab.txt"
TOKENIZER_NAME = "tokenizer.json"
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

"""Run llama.cpp's own convert_hf_to_gguf.py on a checkpoint, as the reference for GGUF names and metadata.

Usage: python _llamacpp_convert.py LLAMA_CPP_SRC MODEL_DIR OUT.gguf

The tiny test checkpoints carry a freshly trained byte-level BPE tokenizer that the converter's table of
known tokenizers cannot recognise (and no SentencePiece model for the families that expect one), so the
converter's vocabulary step is pointed at its plain GPT-2 path; everything else is the converter as shipped.
"""
import runpy
import sys
from pathlib import Path

src, model, out = sys.argv[1:4]
sys.path.insert(0, src)
sys.path.insert(1, str(Path(src) / "gguf-py"))
import conversion.base as base  # noqa: E402
import conversion.phi as phi  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
base.TextModel._set_vocab_sentencepiece = lambda self, add_to_gguf=True: self._set_vocab_gpt2()
phi.Phi3MiniModel.set_vocab = lambda self: self._set_vocab_gpt2()   # Phi-3's own reads tokenizer.model
sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", "f32", "--outfile", out]
runpy.run_path(str(Path(src) / "convert_hf_to_gguf.py"), run_name="__main__")

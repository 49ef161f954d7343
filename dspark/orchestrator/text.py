"""Tokenizer and chat template without transformers.

Inside the Triton python stub, importing transformers pulls in huggingface_hub → ssl, whose
extension module does not load in the stub's embedded interpreter on this machine (undefined
symbol _PyModule_Add: the stub links the system libpython, not the venv's). The `tokenizers`
library and jinja2 are enough: the same tokenizer.json and chat template the target ships.
`tests/unit/test_text.py` checks the ids equal transformers' apply_chat_template.
"""

from __future__ import annotations

import json
from pathlib import Path


class ChatTokenizer:
    def __init__(self, target_dir: Path) -> None:
        import jinja2
        from tokenizers import Tokenizer

        d = Path(target_dir)
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = (
            json.loads((d / "tokenizer_config.json").read_text())
            if (d / "tokenizer_config.json").exists()
            else {}
        )
        template = (
            (d / "chat_template.jinja").read_text()
            if (d / "chat_template.jinja").exists()
            else cfg.get("chat_template")
        )
        if not template:
            raise FileNotFoundError(f"{d}: no chat template (chat_template.jinja or tokenizer_config.json)")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # what transformers uses
        self.template = env.from_string(template)
        self.specials = {k: cfg.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def chat_ids(self, user_text: str) -> list[int]:
        text = self.template.render(
            messages=[{"role": "user", "content": user_text}], add_generation_prompt=True, **self.specials
        )
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

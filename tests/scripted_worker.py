"""An engine worker whose model says what the test wrote: for tests of what the server makes of a model's output
(tool calls, reasoning) that no random or tiny model would produce.

A prompt that holds `«text»` gets `text` (as the tokenizer encodes it), then the end-of-sequence token, whatever
the logits say; other prompts are sampled as usual. Everything else is the real worker: the engine runs its
forwards, streams tokens through its detokenizer and stop strings, and reports as it always does.
Serve with it by patching `qwen4exp.server.supervisor.worker_main` with `scripted_worker_main`.
"""

from __future__ import annotations

import re

from qwen4exp.engine import engine as engine_module
from qwen4exp.engine.sampling import Sampler
from qwen4exp.server.worker import worker_main
from qwen4exp.tokenizer import Tokenizer

SCRIPT = re.compile("«(.*?)»", re.S)


def scripted_sampler(tokenizer: Tokenizer) -> type[Sampler]:
    class ScriptedSampler(Sampler):
        def __init__(self, params, prompt_ids=()):
            super().__init__(params, prompt_ids)
            scripts = SCRIPT.findall(tokenizer.decode(list(prompt_ids)))
            self.script = None if not scripts else tokenizer.encode(scripts[-1]) + tokenizer.eos_token_ids[:1]

        @property
        def takes_argmax(self) -> bool:
            return self.script is None and super().takes_argmax

        def __call__(self, logits):
            if self.script is None:
                return super().__call__(logits)
            token = self.script[min(len(self.history), len(self.script) - 1)]
            return self.take(token)

    return ScriptedSampler


def scripted_worker_main(config, conn, fitted_context, plan) -> None:
    engine_module.Sampler = scripted_sampler(Tokenizer.from_path(config.model))
    worker_main(config, conn, fitted_context, plan)

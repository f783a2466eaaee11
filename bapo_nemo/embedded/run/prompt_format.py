"""How a model trained here is prompted, for whoever loads it (hf_final, `bapo-nemo export`): a chat
template that turns a question into exactly the training prompt (`tokenizer.apply_chat_template`), and a
model card section that says the format, with an example. The training prompt is one user turn of the
tokenizer's chat template, or BOS and the question without one (evaluation.encode_prompt); a tokenizer
without a template gets one that does the latter, one with its own keeps it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bapo_nemo.embedded.loop.evaluation import encode_prompt

# A question of the bundled tasks and its answer as the model writes it, for runs that recorded none.
BUNDLED_EXAMPLE = {"question": "7+5-3?", "answer": "9", "solution": "7+5=12;12-3=9;#9"}


@dataclass
class PromptFormat:
    """How one run's prompts were built, and the tokenizer to save so that its chat template builds them."""

    template: str  # the text the questions were put in ("{prompt}": as they are)
    bundled: str | None  # the bundled arithmetic tasks, as the run had them (`bundled_tasks_text`); None: a dataset
    tokenizer: Any  # the run's tokenizer, with a chat template that builds its prompts
    own_chat_template: bool  # the tokenizer came with its chat template (then the question goes in the text first)

    def content(self, question: str) -> str:
        """What a user message holds for `question` (the template is applied by the chat template or not)."""
        return self.template.replace("{prompt}", question) if self.own_chat_template else question

    def chat_ids(self, tokenizer, question: str) -> list[int]:
        """The prompt `tokenizer`'s chat template makes of `question` (the public path)."""
        return tokenizer.apply_chat_template([{"role": "user", "content": self.content(question)}],
                                             add_generation_prompt=True, return_dict=True)["input_ids"]

    def training_ids(self, training_tokenizer, question: str) -> list[int]:
        """The prompt the trainer made of `question` (evaluation.encode_prompt)."""
        return encode_prompt(training_tokenizer, self.template.replace("{prompt}", question))

    def section(self, example: dict | None, max_new_tokens: int, response: str | None = None,
                when: str = "at export") -> str:
        return prompt_section(self.template, self.bundled, self.own_chat_template,
                              self.tokenizer.bos_token is not None, example, max_new_tokens, response, when)


def prompt_format(tokenizer, config: dict) -> PromptFormat:
    """The prompt format of a run of `config` (a checkpoint's config.yaml) with `tokenizer`."""
    template = training_template(config)
    prompting = prompting_tokenizer(tokenizer, template)
    bundled = None if ((config.get("data") or {}).get("train") or {}).get("data_path") else bundled_tasks_text(config)
    return PromptFormat(template, bundled, prompting, prompting is tokenizer)


def bundled_tasks_text(config: dict) -> str:
    """What the bundled tasks of a run of `config` were: its task file, or the generator's settings (the
    generator writes `+` and `-` only, on operands 1 to task.max_operand)."""
    from bapo_nemo.embedded.config.run_config import TaskConfig

    task = TaskConfig(**{k: v for k, v in (config.get("task") or {}).items() if k in TaskConfig.model_fields})
    if task.train_file:
        return f"The questions were the tasks of the run's file `{Path(task.train_file).name}`"
    ops = f"{task.min_ops}" if task.min_ops == task.max_ops else f"{task.min_ops} to {task.max_ops}"
    digits = "single-digit operands 1 to 9" if task.max_operand == 9 else f"operands 1 to {task.max_operand}"
    return (f"The questions were the bundled generated arithmetic tasks: {ops} operations, each `+` or `-`, on "
            f"{digits}, evaluated left to right with every intermediate value in 0 to {task.max_value}, ending "
            "in `?` (e.g. `7+5-3?`); no `*`")


def run_example(question: str, answer: str, solution: str | None, template: str) -> dict:
    """A held-out task of a run as a card's example: its question as the user writes it (without the
    template around it), reference answer and solution."""
    prefix, _, rest = template.partition("{prompt}")
    suffix = rest.split("{prompt}")[-1] if rest else ""
    if question.startswith(prefix) and question.endswith(suffix) and len(question) >= len(prefix) + len(suffix):
        question = question[len(prefix): len(question) - len(suffix)]
    return {"question": question, "answer": answer, "solution": solution}


def greedy_response(model, fmt: PromptFormat, question: str, max_new_tokens: int) -> str:
    """The model's greedy answer to `question`, prompted through the chat template it is saved with."""
    import torch

    ids = torch.tensor([fmt.chat_ids(fmt.tokenizer, question)], device=next(model.parameters()).device)
    pad = fmt.tokenizer.pad_token_id if fmt.tokenizer.pad_token_id is not None else fmt.tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad)
    return fmt.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def training_template(config: dict) -> str:
    """The text a run's questions were put in: `data.prompt_template` for a dataset; the bundled tasks'
    questions went in as they are."""
    data = config.get("data") or {}
    if not (data.get("train") or {}).get("data_path"):
        return "{prompt}"
    return data.get("prompt_template") or "{prompt}"


def prompting_tokenizer(tokenizer, template: str):
    """`tokenizer`, or, when it has no chat template, a copy with one whose rendering of the last user
    message is the training prompt: BOS (if it has one), then `template` with {prompt} replaced by the
    message. Rendered and encoded without special tokens, as `apply_chat_template` encodes, it gives the
    trainer's ids."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer
    parts = " ~ message ~ ".join(json.dumps(part, ensure_ascii=False) for part in template.split("{prompt}"))
    bos = "{{ bos_token }}" if tokenizer.bos_token is not None else ""
    chat_template = (
        "{%- set ns = namespace(message='') -%}"
        "{%- for m in messages if m['role'] == 'user' -%}{%- set ns.message = m['content'] -%}{%- endfor -%}"
        "{%- set message = ns.message -%}" + bos + "{{ " + parts + " }}"
    )
    copied = copy.deepcopy(tokenizer)
    copied.chat_template = chat_template
    return copied


def prompt_section(template: str, bundled: str | None, own_chat_template: bool, has_bos: bool, example: dict | None,
                   max_new_tokens: int, response: str | None = None, when: str = "at export") -> str:
    """The model card's section on prompting: the format, code that builds the prompt with
    `apply_chat_template` and answers greedily with up to `max_new_tokens`, and `example` (a held-out question
    of the run with its reference answer, and solution) with this model's `response` to it from that very
    code (taken `when`), if known."""
    question = (example or {}).get("question", "your question")
    if own_chat_template:
        content = template.replace("{prompt}", question)
        how = ("Each training prompt was the question put in the text below (`{prompt}` is where it goes), given "
               "to the tokenizer's own chat template as one user turn with the assistant turn opened. Put your "
               "question in that text first, as `content` in the code does.\n\n" + _block(template))
    else:
        content = question
        what = ("the question alone" if template == "{prompt}" else
                "the question put in the text below (`{prompt}` is where it goes)")
        how = (f"Each training prompt was {'the BOS token, then ' if has_bos else ''}{what}. The tokenizer's chat "
               "template builds exactly that from a user message, so `apply_chat_template` gives the training "
               "prompt." + ("" if template == "{prompt}" else "\n\n" + _block(template)))
    lines = ["## How to prompt it", "", how.rstrip("\n"), ""]
    if bundled:
        lines += [(f"{bundled}. The answer is the steps, then `#` and the value. Questions of another kind were "
                   "not trained on. The vocabulary is digits, `+-*=;#?` and space only: English (`What is 3 + 4?`) "
                   "is not a prompt this model can read."), ""]
    lines += ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              'tokenizer = AutoTokenizer.from_pretrained("path/to/this/model")',
              'model = AutoModelForCausalLM.from_pretrained("path/to/this/model")',
              f'messages = [{{"role": "user", "content": {json.dumps(content, ensure_ascii=False)}}}]',
              'inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",',
              "                                       return_dict=True)",
              f"output = model.generate(**inputs, max_new_tokens={max_new_tokens}, do_sample=False)",
              'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
              "```", ""]
    if example is not None:
        if example.get("answer") is not None:
            written = f" (written `{example['solution']}`)" if bundled and example.get("solution") else ""
            lines.append(f"Example, a held-out question of the run: `{question}`, reference answer "
                         f"`{example['answer']}`{written}.")
        else:
            lines.append(f"Example question: `{question}`.")
        if response is not None:
            lines.append(f"This model's greedy response {when}: `{response.strip()}`.")
        lines.append("")
    return "\n".join(lines)


def _block(text: str) -> str:
    return "```\n" + text + "\n```\n"


def final_model_card(tokenizer, config: dict, example: dict | None, step: int, run_id: str | None,
                     model_name: str) -> tuple[Any, str]:
    """(the tokenizer to save, README.md) of a run's hf_final: the card names the model, the step and the
    MLflow run, and says how to prompt it; it holds no local path (a model directory shows by its name)."""

    from bapo_nemo.embedded.model.policy import is_hub_id

    fmt = prompt_format(tokenizer, config)
    shown = Path(model_name).name if Path(model_name).expanduser().exists() or not is_hub_id(model_name) else model_name
    card = (f"---\nlibrary_name: transformers\ntags: [bapo, reinforcement-learning, grpo]\n---\n"
            f"# {shown} trained with BAPO\n\nThe final model of a bapo-nemo run: step {step}, MLflow run "
            f"`{run_id}`. `bapo-nemo export` of the run adds a parity check and the run's BAPO settings to its card."
            f"\n\n{fmt.section(example, response_tokens(config))}")
    return fmt.tokenizer, card


def response_tokens(config: dict, most: int = 128) -> int:
    """New tokens the card's code generates: the run's response length limit, at most `most`."""
    return min((config.get("partial_rollouts") or {}).get("max_response_tokens") or most, most)

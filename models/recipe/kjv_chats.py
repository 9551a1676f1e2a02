"""The training text: the King James Bible from Debian's bible-kjv-text, turned into chat turns.

The text ships compressed in /usr/lib/bible.data (package bible-kjv-text); its reader, `bible`, comes
with the package bible-kjv, which depends on it. `bible -l0 gen1:1-rev22:21` prints every chapter as
a "Book N" heading line followed by one "  N text" line per verse.
"""

import random
import re
import shutil
import subprocess
from pathlib import Path

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

PACKAGES = ("bible-kjv-text", "bible-kjv")
WHOLE_BIBLE = "gen1:1-rev22:21"
TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
VERSE_LINE = re.compile(r"^\s+\d+ (.*)$")
MIN_WORDS_TO_SPLIT = 8  # a verse this long may be cut mid-way between prompt and reply


class MissingTextError(RuntimeError):
    pass


def package_versions():
    """{'bible-kjv-text': '4.38', ...} as dpkg reports them."""
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${Version}\n", *PACKAGES], capture_output=True, text=True, check=True
    ).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


def read_chapters():
    """All 1,189 chapters as lists of verse strings, in canonical order."""
    if shutil.which("bible") is None:
        raise MissingTextError("the KJV text is missing: run `apt-get install bible-kjv` (pulls in bible-kjv-text)")
    out = subprocess.run(["bible", "-l0", WHOLE_BIBLE], capture_output=True, text=True, check=True).stdout
    chapters = []
    for line in out.splitlines():
        verse = VERSE_LINE.match(line)
        if verse:
            chapters[-1].append(verse.group(1).strip())
        elif line.strip():
            chapters.append([])  # a "Book N" heading opens a chapter
    return chapters


def split_chapters(chapters, held_out_fraction, seed):
    """(train, held_out): whole chapters, a seeded random held_out_fraction of them held out."""
    order = list(range(len(chapters)))
    random.Random(seed).shuffle(order)
    n_held = round(len(chapters) * held_out_fraction)
    held = set(order[:n_held])
    train = [c for i, c in enumerate(chapters) if i not in held]
    return train, [chapters[i] for i in sorted(held)]


def passage_turn(verses, i, rng):
    """One (prompt, reply, next_index) from verse i on: the user gives the start of a passage (a whole
    verse, or the first words of one), the assistant continues it for a few verses."""
    words = verses[i].split()
    if len(words) >= MIN_WORDS_TO_SPLIT and rng.random() < 0.5:
        cut = rng.randint(3, len(words) - 3)
        prompt, reply_start, fewest_more = " ".join(words[:cut]), [" ".join(words[cut:])], 0
    else:
        prompt, reply_start, fewest_more = verses[i], [], 1
    n_more = rng.randint(fewest_more, 3)
    reply = " ".join(reply_start + verses[i + 1 : i + 1 + n_more])
    return prompt, reply, i + 1 + n_more


def chapter_conversations(verses, rng):
    """A chapter read through as conversations of one to three turns, in order."""
    conversations, i = [], 0
    while i < len(verses) - 1:
        messages = []
        for _ in range(rng.randint(1, 3)):
            if i >= len(verses) - 1:
                break
            prompt, reply, i = passage_turn(verses, i, rng)
            if reply:
                messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
        if messages:
            conversations.append(messages)
    return conversations


def load_template():
    # the settings transformers uses for chat templates
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    return env.from_string(TEMPLATE_PATH.read_text())


def render_conversation(template, messages, enable_thinking):
    """(prompt, reply) as the model meets them when it writes the last reply: history and generation
    prompt through the template (enable_thinking=False adds the empty think block), then the reply and
    its <|im_end|>. They are tokenized apart, as prompt and generated text are in a chat."""
    extra = {} if enable_thinking else {"enable_thinking": False}
    prompt = template.render(messages=messages[:-1], add_generation_prompt=True, **extra)
    return prompt, messages[-1]["content"] + "<|im_end|>\n"


def chat_pairs(chapters, seed):
    """Every chapter as rendered (prompt, reply) conversations, shuffled; half with the empty think block."""
    rng = random.Random(seed)
    template = load_template()
    conversations = [c for verses in chapters for c in chapter_conversations(verses, rng)]
    rng.shuffle(conversations)
    return [render_conversation(template, c, enable_thinking=rng.random() < 0.5) for c in conversations]

"""Build examples/data/prompts.parquet: a few hundred varied, short instruction prompts.

Deterministic (fixed seed), standard library + pyarrow only. Run from anywhere:
    python examples/data/make_prompts.py
Columns: id (string), category (string), prompt (string).
"""

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TOPICS = [
    "the moon", "coffee", "volcanoes", "the printing press", "honeybees", "rainbows", "the Roman Empire",
    "photosynthesis", "chess", "the internet", "glaciers", "octopuses", "bicycles", "jazz", "the Sahara",
    "vaccines", "lighthouses", "origami", "black holes", "bread baking", "the Great Wall of China", "tides",
    "electric cars", "whales", "the periodic table", "libraries", "thunderstorms", "penguins", "compost",
    "the violin", "solar panels", "mountains", "the human heart", "maps", "dinosaurs", "sleep", "tea",
    "recycling", "the alphabet", "earthquakes",
]
TEMPLATES = [
    ("explain", "Explain {t} to a ten-year-old in two sentences."),
    ("facts", "List three surprising facts about {t}."),
    ("poem", "Write a short poem about {t}."),
    ("question", "What is the most important thing to know about {t}?"),
    ("story", "Write the opening sentence of a story about {t}."),
    ("compare", "Compare {t} and {u} in one paragraph."),
    ("title", "Suggest a catchy title for an article about {t}."),
    ("quiz", "Write one multiple-choice quiz question about {t}, with the answer."),
]
ARITHMETIC = "What is {a} plus {b}? Answer with the number only."
TRANSLATE = "Translate into French: '{s}'"
SENTENCES = ["Good morning, how are you?", "The cat sleeps on the sofa.", "I would like a cup of tea.",
             "Where is the train station?", "It is raining today.", "This book is very interesting."]


def build(n: int = 300, seed: int = 0) -> pa.Table:
    rng = random.Random(seed)
    ids, categories, prompts = [], [], []
    for i in range(n):
        roll = rng.random()
        if roll < 0.08:
            category, prompt = "arithmetic", ARITHMETIC.format(a=rng.randint(2, 99), b=rng.randint(2, 99))
        elif roll < 0.15:
            category, prompt = "translate", TRANSLATE.format(s=rng.choice(SENTENCES))
        else:
            category, template = rng.choice(TEMPLATES)
            t, u = rng.sample(TOPICS, 2)
            prompt = template.format(t=t, u=u)
        ids.append(f"ex-{i:04d}")
        categories.append(category)
        prompts.append(prompt)
    return pa.table({"id": ids, "category": categories, "prompt": prompts})


if __name__ == "__main__":
    out = Path(__file__).with_name("prompts.parquet")
    table = build()
    pq.write_table(table, out)
    print(f"wrote {table.num_rows} prompts to {out}")

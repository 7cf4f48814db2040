"""Prompts for the EAGLE head: training prompts built from the King James Bible, and the
held-out free-text prompts the benchmark and Chapter 9 measure on.

Training prompts are written instruction templates filled with material drawn from the KJV
(public domain; verses from Debian's ``bible-kjv-text``, read through its ``bible`` program) and
with a fixed list of subjects of that world (shepherds, vineyards, bread). The held-out prompts
ask about modern subjects (robots, computers, trains) and include Chapter 9's free-text prompts
("Write a short story about a robot." and "... who learns to paint."); no held-out prompt is a
training prompt (:func:`training_prompts` checks it), and no everyday training prompt names a
held-out subject (the KJV prompts are not filtered: "a city gate" is one of their subjects).
The instruction forms are not held out: since commit e198146 every held-out prompt's form is
among the training templates (everyday and KJV together), word for word for eleven ("Tell me
about the history of ...", "Write a poem about ...") and in other words for five ("Write a note
to ..." for an email).

A fraction of the training prompts (``everyday``; 0.8 of draws in the shipped head's run) are
everyday requests of the kind chat models are asked (stories, explanations, tips, letters,
recipes, comparisons) about modern subjects written here; :func:`training_prompts` refuses any
that names a held-out subject (:data:`HELD_OUT_WORDS`), so these share the held-out set's
register and its instruction forms, never its subjects. (EAGLE's own heads are trained on
ShareGPT conversations and measured on MT-bench's, different conversations.)
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess

HELD_OUT = [
    "Write a short story about a robot.",
    "Write a short story about a robot who learns to paint.",
    "Write a short story about a girl who builds a rocket.",
    "Explain how a computer stores information.",
    "Write an email to your manager asking for a day off.",
    "What are the benefits of learning a second language?",
    "Describe a busy train station in the morning.",
    "Give me three tips for staying focused while studying.",
    "Write a poem about the lights of a big city at night.",
    "Explain why the sky is blue.",
    "What should I pack for a weekend camping trip?",
    "Write a product description for a new smartphone.",
    "Tell me about the history of the bicycle.",
    "How do I make a cup of tea?",
    "Write a short dialogue between a teacher and a student.",
    "Describe what a typical day looks like for a nurse.",
]

VERSE_TEMPLATES = [
    "Explain this verse in simple words: {v}",
    "Retell this passage as a short story for children: {v}",
    "What lesson can we learn from this passage? {v}",
    "Summarize the following passage in one sentence: {v}",
    "Rewrite this verse in modern English: {v}",
    "Write a short poem inspired by this line: {v}",
    "Who is speaking in this passage, and to whom? {v}",
    "List the people and places named in this passage: {v}",
    "Continue this passage in the same style: {v}",
    "Translate this verse into plain, everyday language: {v}",
]
SUBJECT_TEMPLATES = [
    "Write a short story about {s}.",
    "Describe {s} in a few sentences.",
    "Write a letter to a friend about {s}.",
    "Write a poem about {s}.",
    "Tell me about {s}.",
    "Why was {s} important to people in ancient times?",
]
SUBJECTS = [
    "a shepherd and his flock", "a lost sheep", "a vineyard", "a fisherman on a lake",
    "a storm at sea", "the harvest", "a king and his court", "a widow and her son",
    "a carpenter", "a loaf of bread", "a walled garden", "a journey through the desert",
    "a tower of stone", "a river in flood", "a mountain at dawn", "a wedding feast",
    "a potter at his wheel", "a well in a dry land", "a city gate", "a lamp in the dark",
    "an olive tree", "a fig tree", "a caravan of camels", "a temple", "a field of wheat",
    "a young prophet", "two brothers who quarrel", "a great flood", "a herd of goats",
    "a merchant and his scales", "a jar of oil", "a crown of gold", "a plague of locusts",
    "a famine in the land", "a shepherd boy and a giant", "a ship bound for Tarshish",
    "the stars at night", "a cedar of Lebanon", "a threshing floor", "a wise old judge",
]
ACTIVITIES = [
    "tending a vineyard", "keeping sheep", "baking bread", "building a house of stone",
    "sailing a small boat", "planting olive trees", "making clay pots", "weaving cloth",
    "keeping bees", "digging a well", "travelling through the desert", "sharing a meal",
]
PEOPLE = ["a shepherd", "a fisherman", "a potter", "a scribe", "a farmer", "a carpenter",
          "a merchant", "a soldier", "a weaver", "a baker", "a king", "a servant"]
PAIRS = [("wheat", "barley"), ("a sheep", "a goat"), ("a river", "a sea"), ("silver", "gold"),
         ("a king", "a judge"), ("a tent", "a house"), ("wine", "oil"), ("a psalm", "a proverb"),
         ("a prophet", "a priest"), ("a lion", "a bear")]
OTHER_TEMPLATES = [
    ("Give three tips for {x}.", ACTIVITIES),
    ("What would a day be like for {x}?", PEOPLE),
    ("What is the difference between {x}?", [f"{a} and {b}" for a, b in PAIRS]),
]
# Words naming the held-out prompts' subjects: no everyday training prompt may contain one.
HELD_OUT_WORDS = {
    "robot", "robots", "paint", "painting", "rocket", "rockets", "computer", "computers",
    "information", "email", "manager", "language", "languages", "train", "trains", "station",
    "focused", "studying", "study", "poem", "city", "cities", "lights", "sky", "blue",
    "camping", "pack", "smartphone", "phone", "bicycle", "bike", "tea", "dialogue", "teacher",
    "student", "nurse", "hospital",
}
EVERYDAY_SUBJECTS = [
    "a dog who is afraid of the rain", "a lighthouse keeper", "a lost umbrella",
    "a baker who opens a shop", "two friends on a road trip", "a cat who lives in a library",
    "a boy who finds a treasure map", "an old man and his garden", "a small village by the sea",
    "a snowy winter morning", "a summer afternoon at the beach", "a football match",
    "a family dinner", "the first day at a new job", "a birthday party", "a thunderstorm",
    "a walk in the forest", "a farmer's market", "a detective solving a mystery",
    "a dragon who cannot fly", "a musician playing in the street", "a pair of old shoes",
    "a hot air balloon ride", "an island with no people", "a bakery at dawn",
    "a grandmother's recipe book", "a mountain climber", "a fox and a rabbit",
    "a quiet bookshop", "a rainy Sunday", "a kite festival", "an ant colony",
    "a river that changes its course", "a chess tournament", "an astronaut's first day in space",
    "a girl who practises for a swimming race", "a bus driver on his last route", "a forgotten key",
    "a street market at night", "a boy and his grandfather fishing", "a clock that runs backwards",
    "a tortoise who wants to win a race", "a new neighbour", "a baby elephant",
    "a long queue at the post office", "a sandcastle", "a family moving house",
    "a stray kitten", "an old radio", "a spelling contest", "a penguin who hates the cold",
]
EVERYDAY_TOPICS = [
    "volcanoes", "the moon's phases", "how plants make food", "the water cycle",
    "how vaccines work", "the stock market", "the Roman Empire", "earthquakes", "honeybees",
    "the human heart", "rainbows", "recycling", "the Great Wall of China", "electricity",
    "photosynthesis", "the ocean tides", "how airplanes fly", "dinosaurs", "the Olympic Games",
    "coral reefs", "solar panels", "sleep", "the printing press", "glaciers", "magnets",
    "how bread rises", "the solar system", "antibiotics", "deserts", "the immune system",
    "owls", "the pyramids of Egypt", "hurricanes", "the human brain", "octopuses",
    "wind turbines", "bats", "the Amazon rainforest", "the ancient Greeks", "penguins",
    "clouds", "fungi", "the Vikings", "whales", "salt", "butterflies", "the Arctic",
]
EVERYDAY_TASKS = [
    "saving money", "learning to cook", "sleeping better", "running a first marathon",
    "keeping a house plant alive", "writing a cover letter", "making new friends",
    "staying calm before an exam", "starting a vegetable garden", "training a puppy",
    "organizing a small kitchen", "getting up early", "reading more books",
    "preparing for a job interview", "drinking more water", "cleaning a messy room",
    "learning to swim", "taking better photos", "cooking for a large family", "going for walks",
    "writing a diary", "playing the guitar", "knitting", "planning a birthday party",
    "spending less time online", "baking at home", "keeping chickens", "doing yoga",
]
EVERYDAY_RECIPES = ["pancakes", "a vegetable soup", "scrambled eggs", "a fruit salad",
                    "fresh lemonade", "tomato sauce", "a simple omelette", "rice and beans",
                    "banana bread", "a grilled cheese sandwich"]
EVERYDAY_PAIRS = [("a cat", "a dog"), ("a lake", "an ocean"), ("weather", "climate"),
                  ("a virus", "a bacterium"), ("coffee", "cocoa"),
                  ("a crocodile", "an alligator"), ("a star", "a planet"),
                  ("baking", "frying"), ("a novel", "a short story")]
EVERYDAY_INVENTIONS = ["the umbrella", "the printing press", "the wristwatch", "chocolate",
                       "paper money", "the zipper", "glass", "the piano", "cheese", "the compass",
                       "the bathtub", "the sandwich", "the lawn mower", "ice cream"]
EVERYDAY_PRODUCTS = ["a reusable water bottle", "a pair of running shoes", "a wooden desk",
                     "a winter jacket", "a coffee grinder", "a desk lamp", "a garden hose",
                     "a board game for families", "a set of kitchen knives", "a wool blanket"]
EVERYDAY_JOBS = ["a firefighter", "a baker", "a zookeeper", "a pilot", "a farmer", "a librarian",
                 "a chef", "a mail carrier", "an architect", "a fisherman", "a gardener",
                 "a bus driver", "a journalist", "a plumber", "a park ranger"]
EVERYDAY_OUTINGS = ["a picnic in the park", "a day at the beach", "a friend's wedding",
                    "a long flight", "a music festival", "a ski trip", "a job interview",
                    "a day at the zoo"]
EVERYDAY_MACHINES = ["a refrigerator", "a microwave oven", "a thermometer", "a car engine",
                     "a washing machine", "an elevator", "a camera", "a battery", "a clock",
                     "a vacuum cleaner", "a lock and key"]
EVERYDAY_WHYS = ["leaves change colour in autumn", "the sea is salty", "we have seasons",
                 "bread goes stale", "ice floats on water", "cats purr", "we yawn",
                 "onions make you cry", "metal feels cold", "birds fly south in winter"]
EVERYDAY_DUOS = ["a chef and a customer", "a doctor and a patient", "two neighbours",
                 "a shopkeeper and a child", "a coach and a player", "two old friends",
                 "a pilot and a passenger", "a librarian and a visitor"]
EVERYDAY_NOTES = ["your neighbour thanking them for their help",
                  "your landlord asking to fix the heating",
                  "a friend inviting them to dinner", "your team about a change of plans",
                  "a shop asking about a late delivery", "a colleague who is leaving"]
EVERYDAY_TEMPLATES = [
    ("Write a short story about {x}.", EVERYDAY_SUBJECTS),
    ("Describe {x} in a few sentences.", EVERYDAY_SUBJECTS),
    ("Write a letter to a friend about {x}.", EVERYDAY_SUBJECTS),
    ("Explain {x} to a ten-year-old.", EVERYDAY_TOPICS),
    ("Tell me three interesting facts about {x}.", EVERYDAY_TOPICS),
    ("Why are {x} important?", EVERYDAY_TOPICS),
    ("Write a paragraph about {x}.", EVERYDAY_TOPICS),
    ("Give me five tips for {x}.", EVERYDAY_TASKS),
    ("What are the benefits of {x}?", EVERYDAY_TASKS),
    ("How do I get started with {x}?", EVERYDAY_TASKS),
    ("How do I make {x}?", EVERYDAY_RECIPES),
    ("Write a recipe for {x}.", EVERYDAY_RECIPES),
    ("What is the difference between {x}?", [f"{a} and {b}" for a, b in EVERYDAY_PAIRS]),
    ("Tell me about the history of {x}.", EVERYDAY_INVENTIONS),
    ("Write a product description for {x}.", EVERYDAY_PRODUCTS),
    ("Describe what a typical day looks like for {x}.", EVERYDAY_JOBS),
    ("What should I bring to {x}?", EVERYDAY_OUTINGS),
    ("Explain how {x} works.", EVERYDAY_MACHINES),
    ("Explain why {x}.", EVERYDAY_WHYS),
    ("Write a short conversation between {x}.", EVERYDAY_DUOS),
    ("Write a note to {x}.", EVERYDAY_NOTES),
    ("Write a few lines of verse about {x}.", EVERYDAY_SUBJECTS),
    ("Give me three tips for {x}.", EVERYDAY_TASKS),
]
EVERYDAY_SUFFIXES = ["", " Keep it short.", " Use simple words.", " Answer in a few sentences.",
                     " Make it cheerful."]
VERSE_RE = re.compile(r"^\S+\d+:\d+\s+(.*)$")


def kjv_verses() -> list[str]:
    """Every verse of the KJV from Debian's ``bible`` program (``apt-get install
    bible-kjv-text``), one string each."""
    if shutil.which("bible") is None:
        raise SystemExit("no `bible` program: apt-get install bible-kjv-text")
    raw = subprocess.run(["bible", "-f", "gen1:1-rev22:21"], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, check=True).stdout
    verses = []
    for line in raw.splitlines():
        m = VERSE_RE.match(line.strip())
        if m:
            verses.append(" ".join(m.group(1).split()))
    return verses


def training_prompts(n: int, seed: int = 0, verses: list[str] | None = None,
                     everyday: float = 0.0) -> list[str]:
    """``n`` distinct training prompts, seeded: a fraction ``everyday`` of draws are everyday
    prompts (about 3,000 distinct ones), the rest KJV prompts (about half of
    them carrying one to three consecutive verses); none of them is a held-out prompt."""
    verses = kjv_verses() if verses is None else verses
    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < n:
        kind = rng.random()
        if kind < everyday:
            template, fill = rng.choice(EVERYDAY_TEMPLATES)
            prompt = template.format(x=rng.choice(fill)) + rng.choice(EVERYDAY_SUFFIXES)
            if set(re.findall(r"[a-z]+", prompt.lower())) & HELD_OUT_WORDS:
                raise AssertionError(f"an everyday prompt names a held-out subject: {prompt}")
            out.setdefault(prompt, None)
            continue
        kind = rng.random()
        if kind < 0.5:
            i = rng.randrange(len(verses) - 3)
            text = " ".join(verses[i : i + rng.choice([1, 1, 2, 3])])
            prompt = rng.choice(VERSE_TEMPLATES).format(v=text)
        elif kind < 0.8:
            prompt = rng.choice(SUBJECT_TEMPLATES).format(s=rng.choice(SUBJECTS))
        else:
            template, fill = rng.choice(OTHER_TEMPLATES)
            prompt = template.format(x=rng.choice(fill))
        out.setdefault(prompt, None)
    prompts = list(out)
    clash = set(prompts) & set(HELD_OUT)
    if clash:
        raise AssertionError(f"training prompts include held-out ones: {sorted(clash)}")
    return prompts

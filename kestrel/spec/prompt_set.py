"""A large, varied set of training prompts for self-distillation, built offline from topics x task templates.

32 hand-written prompts did not generalise (teacher-forced slot-1 agreement 0.65 on them, 0.22-0.30 acceptance on
held-out prompts): the head learns the target's habits only from many different contexts. No network is needed,
and none of bench/spec_decode.py's held-out workload prompts is produced verbatim.
"""
from __future__ import annotations

import random

TOPICS = [
    "the moon landing", "volcanoes", "the immune system", "electric cars", "the Roman empire", "black holes",
    "climate change", "the internet", "honey bees", "the stock exchange", "quantum computers", "ocean tides",
    "chess openings", "coffee", "the human brain", "earthquakes", "solar panels", "ancient Egypt", "jazz music",
    "machine translation", "the printing press", "rainforests", "the solar system", "bread baking", "cryptography",
    "penguins", "democracy", "smartphones", "dinosaurs", "the Olympic games", "recycling", "glaciers", "the violin",
    "public libraries", "compilers", "origami", "the Sahara desert", "wind turbines", "the French language",
    "medieval castles", "tea ceremonies", "video games", "the Great Wall of China", "sharks", "the heart",
    "gardening", "photography", "the Renaissance", "nuclear power", "social media", "remote work", "budgeting",
    "time management", "meditation", "marathon training", "vegetarian cooking", "the Amazon river", "owls",
    "the periodic table", "DNA", "gravity", "magnets", "rainbows", "hurricanes", "coral reefs", "bicycles",
    "trains", "the steam engine", "electricity", "batteries", "the Moon's phases", "Mars", "telescopes",
    "ancient Greece", "the Silk Road", "Vikings", "the Industrial Revolution", "World War I", "the Cold War",
    "Shakespeare", "poetry", "novels", "classical music", "rock music", "painting", "sculpture", "architecture",
    "bridges", "skyscrapers", "cities", "farming", "cheese making", "chocolate", "spices", "rice", "pizza",
    "sushi", "soup recipes", "healthy breakfasts", "dogs", "cats", "horses", "elephants", "whales", "ants",
    "butterflies", "mountains", "rivers", "islands", "forests", "deserts", "the Arctic", "the weather",
    "sorting algorithms", "binary search", "linked lists", "hash maps", "recursion", "object-oriented programming",
    "unit testing", "version control", "operating systems", "computer networks", "databases", "web browsers",
    "passwords", "artificial intelligence", "robots", "self-driving cars", "drones", "3D printing",
    "virtual reality", "space stations", "rockets", "satellites", "the ozone layer", "plastic pollution",
    "clean water", "friendship", "job interviews", "writing a resume", "learning to code", "studying for exams",
    "public speaking", "negotiation", "leadership", "teamwork", "starting a business", "saving money",
    "credit cards", "taxes", "insurance", "moving to a new city", "travel packing", "camping", "hiking",
    "swimming", "football", "tennis", "yoga", "sleep", "stress", "happiness", "kindness", "habits",
    "the scientific method", "statistics", "probability", "fractions", "prime numbers", "geometry", "algebra",
    "calculus", "maps", "languages", "libraries", "museums", "holidays", "birthdays", "weddings", "music festivals",
]

TASKS = [
    "Explain {} to a beginner.", "Write a short story involving {}.", "List five facts about {}.",
    "What are the pros and cons of {}?", "Write a short poem about {}.", "Summarize the history of {}.",
    "Give three tips related to {}.", "Write a dialogue between two friends about {}.",
    "What is the most important thing to know about {}?", "Describe {} in simple words.",
    "Write a blog post introduction about {}.", "Explain {} to a ten-year-old.", "Why does {} matter?",
    "Write a product description inspired by {}.", "What are common misconceptions about {}?",
    "Give a step-by-step guide related to {}.", "Compare {} with something similar.",
    "Write a short news report about {}.", "Ask me three quiz questions about {} and give the answers.",
    "Write a letter to a friend about {}.", "What would the future of {} look like?",
    "Explain the science behind {}.", "Write a tweet about {}.", "Tell me a fun fact about {}.",
    "Write an essay outline about {}.", "How would you teach {} in a classroom?",
]

# rewrite / summarise / continue tasks over short template passages (the bench's `edit` workload is of this kind,
# with different passages)
PASSAGE_TASKS = ["Rewrite the following text in a more formal tone:\n\n{}", "Summarize the following text:\n\n{}",
                 "Fix any grammar mistakes and repeat the text:\n\n{}", "Continue the following text:\n\n{}",
                 "Translate the following text into simple English:\n\n{}", "Make the following text shorter:\n\n{}"]
PASSAGES = [
    "Yesterday I visited a museum about {t}. The guide talked for an hour and showed us many old pictures. I learned "
    "a lot, but my feet hurt at the end and the cafe was closed.",
    "Our class is doing a project on {t}. Each group must write two pages, make a poster and give a five minute "
    "talk on Friday. We have not started yet because we cannot agree on a title.",
    "Many people think {t} is boring, but it is actually full of surprises. Experts say that the more you learn "
    "about it, the more questions you have.",
    "The report on {t} was finished on Monday. It found three main problems, suggested two solutions and asked for "
    "more money next year. The board will vote on it next week.",
]


def varied_prompts(n: int | None = None, seed: int = 0) -> list[str]:
    """Topic x task prompts plus passage tasks, shuffled; n cycles/cuts the list (None = all of them)."""
    out = [t.format(x) for x in TOPICS for t in TASKS]
    out += [task.format(p.format(t=x)) for x in TOPICS for p in PASSAGES for task in PASSAGE_TASKS[:2]]
    out += [task.format(p.format(t=x)) for x in TOPICS[::3] for p in PASSAGES for task in PASSAGE_TASKS[2:]]
    random.Random(seed).shuffle(out)
    if n is None:
        return out
    return [out[i % len(out)] for i in range(n)]

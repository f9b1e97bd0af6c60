"""Generates `corpus.txt`, the small English corpus the examples train on (run once; the output is committed).

Paragraphs of simple sentences drawn from a seeded grammar over a few hundred words in a dozen topics:
enough structure for a tiny masked LM to learn something in a few hundred steps, no licensing questions,
no download. Documents are separated by blank lines (the data preparer's "blank" format).

    python examples/data/make_corpus.py   # rewrites examples/data/corpus.txt byte for byte
"""

import random
from pathlib import Path

TOPICS = {
    "weather": (["rain", "wind", "storm", "sun", "fog", "snow", "cloud", "frost", "river", "valley"],
                ["fell", "moved", "settled", "cleared", "returned", "gathered", "faded", "rose"],
                ["cold", "warm", "heavy", "light", "grey", "bright", "sudden", "gentle"]),
    "cooking": (["bread", "soup", "oven", "kitchen", "onion", "garlic", "pan", "recipe", "butter", "flour"],
                ["baked", "stirred", "cooled", "boiled", "tasted", "served", "mixed", "burned"],
                ["fresh", "salty", "sweet", "crisp", "thick", "golden", "simple", "hot"]),
    "travel": (["train", "station", "ticket", "road", "harbour", "map", "bridge", "village", "border", "hotel"],
               ["left", "arrived", "crossed", "waited", "stopped", "turned", "followed", "reached"],
               ["late", "early", "crowded", "quiet", "long", "narrow", "distant", "busy"]),
    "science": (["experiment", "cell", "theory", "signal", "sample", "laboratory", "model", "measurement", "star", "atom"],
                ["confirmed", "predicted", "measured", "observed", "tested", "explained", "produced", "changed"],
                ["careful", "precise", "strange", "small", "new", "stable", "random", "simple"]),
    "history": (["king", "city", "war", "treaty", "empire", "castle", "army", "merchant", "temple", "council"],
                ["built", "ruled", "signed", "defended", "lost", "founded", "destroyed", "governed"],
                ["ancient", "powerful", "old", "wealthy", "famous", "northern", "southern", "great"]),
    "sports": (["team", "match", "player", "goal", "coach", "season", "ball", "race", "field", "crowd"],
               ["won", "scored", "trained", "played", "lost", "finished", "started", "cheered"],
               ["fast", "strong", "young", "tired", "proud", "final", "local", "loud"]),
    "computers": (["program", "server", "network", "file", "memory", "processor", "disk", "screen", "keyboard", "code"],
                  ["crashed", "compiled", "stored", "loaded", "restarted", "copied", "deleted", "updated"],
                  ["slow", "fast", "broken", "large", "remote", "empty", "secure", "old"]),
    "garden": (["tree", "flower", "seed", "leaf", "root", "garden", "fence", "bird", "grass", "apple"],
               ["grew", "bloomed", "dried", "fell", "sprouted", "climbed", "ripened", "spread"],
               ["green", "tall", "red", "wild", "young", "dry", "soft", "tiny"]),
    "music": (["song", "piano", "choir", "violin", "concert", "melody", "drum", "singer", "band", "stage"],
              ["played", "sang", "echoed", "ended", "began", "practised", "recorded", "performed"],
              ["soft", "loud", "sad", "joyful", "slow", "quick", "familiar", "beautiful"]),
    "sea": (["ship", "wave", "sailor", "island", "coast", "fish", "net", "lighthouse", "tide", "boat"],
            ["sailed", "drifted", "sank", "anchored", "crashed", "floated", "landed", "returned"],
            ["deep", "blue", "rough", "calm", "salty", "endless", "dark", "open"]),
}
PEOPLE = ["Anna", "the old man", "my sister", "the teacher", "a stranger", "the doctor", "our neighbour",
          "the children", "the captain", "a farmer", "the students", "her brother"]
TIMES = ["in the morning", "at night", "after dinner", "before the winter", "on Sunday", "every year",
         "last week", "for a long time", "by noon", "during the summer"]
CONNECT = ["because", "although", "while", "when", "after", "before", "so", "but", "and"]
PLACES = ["near the river", "in the city", "on the hill", "behind the house", "at the market",
          "across the valley", "under the bridge", "by the sea"]


def sentence(rng: random.Random, topic: str) -> str:
    nouns, verbs, adjs = TOPICS[topic]
    n1, n2 = rng.sample(nouns, 2)
    v1, v2 = rng.sample(verbs, 2)
    a1, a2 = rng.sample(adjs, 2)
    person = rng.choice(PEOPLE)
    forms = [
        f"The {a1} {n1} {v1} {rng.choice(PLACES)} {rng.choice(TIMES)}.",
        f"{person.capitalize()} said that the {n1} {v1} {rng.choice(CONNECT)} the {a2} {n2} {v2}.",
        f"{rng.choice(TIMES).capitalize()}, {person} {v1} the {a1} {n1}.",
        f"Nobody knew why the {n1} was so {a1}, {rng.choice(CONNECT)} everyone agreed that the {n2} {v2}.",
        f"There was a {a1} {n1} and a {a2} {n2} {rng.choice(PLACES)}.",
        f"When the {n1} {v1}, {person} {v2} {rng.choice(PLACES)}.",
        f"Is it true that the {n1} {v1} {rng.choice(TIMES)}?",
        f"{person.capitalize()} {v1} {rng.randint(2, 99)} {n1}s and {rng.randint(2, 99)} {n2}s {rng.choice(TIMES)}.",
    ]
    return rng.choice(forms)


def paragraph(rng: random.Random) -> str:
    topic = rng.choice(sorted(TOPICS))
    return "\n".join(sentence(rng, topic if rng.random() < 0.85 else rng.choice(sorted(TOPICS)))
                     for _ in range(rng.randint(3, 7)))


def main() -> None:
    rng = random.Random(20261123)
    paragraphs, size = [], 0
    while size < 300_000:
        p = paragraph(rng)
        paragraphs.append(p)
        size += len(p) + 2
    Path(__file__).with_name("corpus.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

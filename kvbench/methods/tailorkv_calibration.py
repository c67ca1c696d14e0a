"""A self-written stand-in for TailorKV's calibration data: 50 grade-school math word problems with worked answers.

This is NOT GSM8K. The official identification (`search_pattern.py` in ydyhello/TailorKV) prefilled the first 50
pairs of the real GSM8K `main` train split; pass that file to `python -m kvbench.methods.tailorkv_layers
--calibration <gsm8k train .jsonl|.parquet>` to reproduce it. This module only exists so the command runs offline
with no dataset: the problems are generated from six templates written for kvbench, with numbers drawn from a seeded
`random.Random`, so the text is identical on every machine.

The answers imitate GSM8K's answer style, because that style is what the calibration prompt is made of: one reasoning
step per line, each with a calculator annotation `<<expression=result>>`, and a last line `#### <number>`. Every
annotation is computed here, so it is exact (divisions are set up to come out whole).
"""
from __future__ import annotations

import random

PEOPLE = [("Maya", "she"), ("Tomas", "he"), ("Priya", "she"), ("Omar", "he"), ("Lena", "she"), ("Kofi", "he"),
          ("Hana", "she"), ("Diego", "he"), ("Ines", "she"), ("Ravi", "he"), ("Greta", "she"), ("Felix", "he")]


def _shopping(rng: random.Random, name: str, he: str) -> tuple[str, str]:
    count, price, bag = rng.randint(3, 9), rng.randint(2, 7), rng.randint(12, 40)
    cost = count * price
    total = cost + bag
    question = (f"{name} buys {count} notebooks for ${price} each and a backpack for ${bag}. "
                f"How much money does {he} spend in all?")
    answer = (f"The notebooks cost {count}*{price} = <<{count}*{price}={cost}>>{cost} dollars.\n"
              f"Together with the backpack, {name} spends {cost}+{bag} = <<{cost}+{bag}={total}>>{total} dollars.\n"
              f"#### {total}")
    return question, answer


def _baking(rng: random.Random, name: str, he: str) -> tuple[str, str]:
    trays, per_tray = rng.randint(3, 8), rng.randint(6, 15)
    baked = trays * per_tray
    sold = rng.randint(5, baked - 5)
    left = baked - sold
    question = (f"{name} bakes {trays} trays of muffins with {per_tray} muffins on each tray. {he.capitalize()} "
                f"sells {sold} muffins at the school fair. How many muffins does {he} have left?")
    answer = (f"{name} bakes {trays}*{per_tray} = <<{trays}*{per_tray}={baked}>>{baked} muffins.\n"
              f"After the fair {he} has {baked}-{sold} = <<{baked}-{sold}={left}>>{left} muffins left.\n"
              f"#### {left}")
    return question, answer


def _printing(rng: random.Random, name: str, he: str) -> tuple[str, str]:
    rate, booklets = rng.randint(2, 6), rng.randint(4, 12)
    pages = rate * rng.randint(2, 6)  # a multiple of the rate, so the minutes come out whole
    total = booklets * pages
    minutes = total // rate
    question = (f"{name}'s printer prints {rate} pages per minute. {he.capitalize()} needs {booklets} booklets "
                f"with {pages} pages each. How many minutes will the printing take?")
    answer = (f"The booklets have {booklets}*{pages} = <<{booklets}*{pages}={total}>>{total} pages in total.\n"
              f"At {rate} pages per minute, that takes {total}/{rate} = <<{total}/{rate}={minutes}>>{minutes} "
              f"minutes.\n#### {minutes}")
    return question, answer


def _savings(rng: random.Random, name: str, he: str) -> tuple[str, str]:
    earned = 2 * rng.randint(15, 60)
    gift = earned // 2
    rest = earned - gift
    saved = rng.randint(3, rest - 2)
    left = rest - saved
    question = (f"{name} earns ${earned} washing cars. {he.capitalize()} spends half of it on a gift for a friend "
                f"and puts ${saved} into a savings jar. How many dollars does {he} have left to spend?")
    answer = (f"The gift costs {earned}/2 = <<{earned}/2={gift}>>{gift} dollars.\n"
              f"After the gift, {name} has {earned}-{gift} = <<{earned}-{gift}={rest}>>{rest} dollars.\n"
              f"After saving, {he} has {rest}-{saved} = <<{rest}-{saved}={left}>>{left} dollars left.\n"
              f"#### {left}")
    return question, answer


def _reading(rng: random.Random, name: str, he: str) -> tuple[str, str]:
    weekday, weekend, weeks = rng.randint(5, 20), rng.randint(10, 40), rng.randint(2, 5)
    a, b = 5 * weekday, 2 * weekend
    week = a + b
    total = week * weeks
    question = (f"{name} reads {weekday} pages on each weekday and {weekend} pages on each day of the weekend. "
                f"How many pages does {he} read in {weeks} weeks?")
    answer = (f"On the five weekdays {he} reads 5*{weekday} = <<5*{weekday}={a}>>{a} pages.\n"
              f"On the two weekend days {he} reads 2*{weekend} = <<2*{weekend}={b}>>{b} pages.\n"
              f"So {he} reads {a}+{b} = <<{a}+{b}={week}>>{week} pages a week.\n"
              f"In {weeks} weeks {he} reads {week}*{weeks} = <<{week}*{weeks}={total}>>{total} pages.\n"
              f"#### {total}")
    return question, answer


def _farm(rng: random.Random, name: str, he: str) -> tuple[str, str]:
    cows, times, fewer = rng.randint(6, 25), rng.randint(2, 5), rng.randint(1, 5)
    hens, goats = cows * times, cows - fewer
    total = cows + hens + goats
    question = (f"{name}'s farm has {cows} cows. There are {times} times as many hens as cows, and {fewer} fewer "
                f"goats than cows. How many animals are on the farm?")
    answer = (f"There are {cows}*{times} = <<{cows}*{times}={hens}>>{hens} hens.\n"
              f"There are {cows}-{fewer} = <<{cows}-{fewer}={goats}>>{goats} goats.\n"
              f"Altogether there are {cows}+{hens}+{goats} = <<{cows}+{hens}+{goats}={total}>>{total} animals.\n"
              f"#### {total}")
    return question, answer


TEMPLATES = (_shopping, _baking, _printing, _savings, _reading, _farm)


def stand_in_pairs(n: int = 50, seed: int = 0) -> list[tuple[str, str]]:
    """`n` (question, answer) pairs, the templates taken in turn, people and numbers drawn from `Random(seed)`."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        name, he = rng.choice(PEOPLE)
        pairs.append(TEMPLATES[i % len(TEMPLATES)](rng, name, he))
    return pairs

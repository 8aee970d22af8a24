"""Human-style chat requests for self-distillation: code, short creative forms, how-to, explain, compare, emails,
recipes, travel, books, history, health (templates x fillers, ~1.9k distinct).

Why: session 4 R1 measured the same head at 2.78 tokens/verify (k=4) on held-out self-written / topic-template
prompts but 1.96 on bench/spec_decode.py's human-written chat questions: the target's answers to those (code,
haiku, notes, how-tos) are styles the 'varied' and 'self' sets hardly contain. None of the bench's held-out
prompts (bench/spec_decode.py WORKLOADS) is produced verbatim (tests/test_spec_draft_training.py checks).
"""
from __future__ import annotations

import random

LANGS = ["Python", "JavaScript", "Java", "C", "C++", "Go", "Rust", "TypeScript", "Ruby", "Bash"]
CODE_TASKS = [
    "checks whether a string is a palindrome", "computes the factorial of a number", "returns the n-th Fibonacci "
    "number", "finds the largest number in a list", "removes duplicates from a list", "counts the words in a sentence",
    "merges two sorted lists", "converts Celsius to Fahrenheit", "checks whether a number is prime",
    "reverses the words in a sentence", "sorts a list of numbers with bubble sort", "implements binary search",
    "flattens a nested list", "counts how often each character appears in a string", "reads a file and prints "
    "its lines", "computes the average of a list of numbers", "finds the second largest element of an array",
    "checks whether two strings are anagrams", "implements a stack with push and pop", "computes the greatest "
    "common divisor of two numbers", "capitalizes the first letter of every word", "generates a random password",
    "transposes a matrix", "sums the digits of an integer", "finds the longest word in a sentence",
    "implements a simple queue", "validates that brackets in a string are balanced", "converts a decimal number "
    "to binary", "returns the intersection of two lists", "rotates an array by k positions",
]
SQL_TASKS = ["lists the ten most expensive products", "finds customers who placed no orders", "computes the average "
             "salary per department", "returns the newest order of every customer", "counts users who signed up "
             "each month", "deletes duplicate rows from a table", "joins the employees and departments tables",
             "finds the top three students by score in each class"]
CONCEPTS = ["a closure", "a pointer", "a REST API", "garbage collection", "a race condition", "dependency injection",
            "a binary tree", "big O notation", "a virtual machine", "an interface", "polymorphism", "a deadlock",
            "a compiler", "an interpreter", "a hash function", "a regular expression", "a container", "caching",
            "a load balancer", "multithreading", "async/await", "a foreign key", "normalization in databases",
            "a lambda function", "a memory leak", "unit tests", "continuous integration", "an exception",
            "a generator in Python", "a decorator in Python", "type inference", "a linked list", "DNS", "HTTPS",
            "a cookie in web browsers", "JSON", "a websocket", "an operating system kernel", "a mutex", "Docker"]
FORMS = ["a haiku", "a limerick", "a short poem", "a sonnet", "a short story", "a fable", "a riddle", "a joke",
         "a song chorus", "a bedtime story", "a two-sentence horror story", "a free verse poem", "a short fairy tale"]
SUBJECTS = ["a lost umbrella", "the first snow of winter", "a sleepy cat", "a city at night", "an old bookshop",
            "a robot learning to paint", "a summer thunderstorm", "a brave little mouse", "the sea at dawn",
            "a forgotten key", "a train journey", "a garden in spring", "a lonely astronaut", "a village baker",
            "a talking tree", "coffee in the morning", "a broken clock", "a migrating bird", "a rainy Monday",
            "a wizard who lost his hat", "the desert at noon", "an abandoned house", "a first day at school",
            "a fox in the snow", "the last leaf on a tree", "a kite on a windy day", "a pirate's parrot",
            "a mountain village", "a jar of fireflies", "a sandcastle", "a detective dog", "an autumn forest",
            "a street musician", "a paper boat", "the night sky", "a grandmother's recipe", "a tiny dragon",
            "a snowman in April", "a busy beehive", "a long-lost letter"]
HOWTOS = ["learn to play the guitar", "make a budget", "write a cover letter", "plant tomatoes", "fix a flat "
          "bicycle tire", "brew good coffee at home", "stay focused while studying", "prepare for a job interview",
          "clean a cast iron pan", "start a vegetable garden", "train a puppy", "write a good essay",
          "save money on groceries", "make friends in a new city", "improve my handwriting", "learn to swim as an "
          "adult", "organize my closet", "take better photos with my phone", "reduce screen time", "make bread "
          "without yeast", "back up my computer", "write a haiku", "remove a coffee stain", "memorize a speech",
          "care for a succulent", "make a paper airplane", "get better at chess", "set up a home office",
          "cook rice on the stove", "change a car tire", "write a short story", "learn a programming language",
          "meditate", "wake up earlier", "plan a road trip", "keep a journal", "deal with stress at work",
          "tie a tie", "sharpen a kitchen knife", "make a smoothie"]
PAIRS = [("a list", "a tuple in Python"), ("HTTP", "HTTPS"), ("RAM", "storage"), ("a crocodile", "an alligator"),
         ("a simile", "a metaphor"), ("affect", "effect"), ("a comet", "an asteroid"), ("baking soda",
         "baking powder"), ("a debit card", "a credit card"), ("speed", "velocity"), ("a republic", "a democracy"),
         ("mitosis", "meiosis"), ("SQL", "NoSQL databases"), ("a process", "a thread"), ("Java", "JavaScript"),
         ("a hurricane", "a tornado"), ("stocks", "bonds"), ("a frog", "a toad"), ("an LED", "an incandescent "
         "bulb"), ("classical", "operant conditioning"), ("a lake", "a pond"), ("git merge", "git rebase"),
         ("a compiler", "an interpreter"), ("AC", "DC current"), ("a rabbit", "a hare"), ("latitude",
         "longitude"), ("an emulsion", "a suspension"), ("TCP", "HTTP"), ("a violin", "a viola"),
         ("renting", "buying a house"), ("a star", "a planet"), ("a noun", "a pronoun"), ("Linux", "Windows"),
         ("mean", "median"), ("a sprint", "a marathon"), ("a latte", "a cappuccino")]
DISHES = ["banana bread", "vegetable soup", "chocolate chip cookies", "a simple omelette", "guacamole",
          "fried rice", "lemonade", "a Greek salad", "mashed potatoes", "spaghetti carbonara", "hummus",
          "apple pie", "a grilled cheese sandwich", "chicken curry", "overnight oats", "garlic bread",
          "a fruit smoothie", "lentil stew", "French toast", "homemade pizza dough", "roasted vegetables",
          "a chocolate cake", "iced tea", "pesto", "scrambled eggs", "potato salad", "a veggie burger",
          "tomato soup", "brownies", "rice pudding"]
EMAILS = ["to my landlord about a broken heater", "to a client apologizing for a late delivery", "to my team "
          "announcing a new project", "to a professor asking for an extension", "inviting my neighbors to a "
          "barbecue", "to a company asking about a job opening", "to my coworker thanking them for their help",
          "to customer support about a wrong order", "to my friend congratulating them on their wedding",
          "to my manager proposing a remote work day", "declining a meeting invitation politely",
          "to a hotel asking about late check-out", "to a colleague asking for feedback on my report",
          "to parents about a school field trip", "to a supplier asking for a discount"]
IDEAS = ["a rainy weekend", "a team building event", "a science fair project", "a small business", "a family "
         "dinner", "a date night", "a short film", "a blog", "a school fundraiser", "a garden party",
         "healthy snacks", "a gift for my father", "a cheap vacation", "a Halloween costume", "a mobile app",
         "a youtube channel", "a book club meeting", "a picnic", "learning something new this year",
         "a kids' craft afternoon"]
WHYS = ["Why do cats purr?", "Why is the ocean salty?", "Why do we dream?", "Why do onions make us cry?",
        "Why does ice float?", "Why do we get goosebumps?", "Why is the sunset red?", "Why do birds migrate?",
        "Why do we yawn?", "Why does bread rise?", "Why do stars twinkle?", "Why do we have seasons?",
        "Why do magnets attract iron?", "Why is exercise good for the brain?", "Why do some people snore?",
        "Why does the moon change shape?", "Why do we need sleep?", "Why do leaves fall from trees?",
        "Why does metal feel cold?", "Why do dogs wag their tails?", "Why is glass transparent?",
        "Why do balloons pop?", "Why do we hiccup?", "Why does popcorn pop?", "Why do planes leave white trails?"]
THINGS = ["a microwave", "a solar panel", "a touchscreen", "GPS", "a credit score", "a heat pump", "a vaccine",
          "Wi-Fi", "a search engine", "a nuclear reactor", "a battery", "a camera lens", "an elevator", "a 3D printer",
          "an electric motor", "the human heart", "a compass", "a hybrid car", "noise cancelling headphones",
          "a thermostat", "blockchain", "a barcode scanner", "a submarine", "a rainbow", "an antibiotic",
          "inflation", "a mortgage", "the immune system", "a wind turbine", "a smartphone camera", "email",
          "a spreadsheet", "a helicopter", "an X-ray machine", "a washing machine"]

PLACES = ["Paris", "Tokyo", "New York", "Rome", "Barcelona", "Istanbul", "Cairo", "Sydney", "Rio de Janeiro",
          "Kyoto", "Lisbon", "Prague", "Vienna", "Mexico City", "Bangkok", "Cape Town", "Edinburgh", "Amsterdam",
          "Iceland", "the Scottish Highlands", "Yellowstone", "Patagonia", "Bali", "Morocco", "Vancouver"]
WORKS = ["Hamlet", "Pride and Prejudice", "The Odyssey", "Moby-Dick", "1984", "The Great Gatsby", "Frankenstein",
         "Don Quixote", "The Little Prince", "Jane Eyre", "The Hobbit", "Macbeth", "Les Miserables", "Dracula",
         "Alice in Wonderland", "The Iliad", "War and Peace", "Treasure Island", "Oliver Twist", "A Christmas Carol"]
EVENTS = ["the fall of the Roman Empire", "World War II", "the Great Depression", "the American Revolution",
          "the Black Death", "the Industrial Revolution", "the collapse of the Soviet Union", "the Renaissance",
          "the space race", "the 2008 financial crisis", "the invention of the printing press", "the Reformation",
          "the Irish potato famine", "the end of the Cold War", "the building of the pyramids"]
FOODS = ["oatmeal", "green tea", "blueberries", "spinach", "salmon", "almonds", "dark chocolate", "yogurt",
         "broccoli", "lentils", "avocados", "olive oil", "eggs", "sweet potatoes", "garlic", "bananas", "quinoa",
         "honey", "oranges", "beans"]
ITEMS = ["a laptop", "a used car", "running shoes", "a mattress", "a bicycle", "a camera", "a smartphone",
         "a house", "a tent", "a coffee machine", "a winter coat", "a television", "headphones", "a desk chair",
         "a guitar", "a vacuum cleaner", "a backpack", "a printer", "a dog", "houseplants"]
GOALS = ["losing weight", "building muscle", "running a 5k", "improving flexibility", "a busy office worker",
         "a beginner at the gym", "staying fit at home", "better posture", "a senior citizen", "a marathon"]
PHRASES = ["Good morning, how are you?", "Where is the train station?", "Thank you for your help.",
           "I would like a cup of coffee.", "What time is it?", "Nice to meet you.", "How much does this cost?",
           "I am learning your language.", "Can you help me, please?", "Have a nice day."]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Japanese", "Portuguese", "Dutch", "Swedish"]

TEMPLATES = [
    ("Write a {} function that {}.", [LANGS, CODE_TASKS]),
    ("Write a SQL query that {}.", [SQL_TASKS]),
    ("Explain what {} is.", [CONCEPTS]), ("What is {} in programming? Give an example.", [CONCEPTS]),
    ("Write {} about {}.", [FORMS, SUBJECTS]),
    ("How do I {}?", [HOWTOS]), ("Give me step-by-step instructions to {}.", [HOWTOS]),
    ("What is the difference between {} and {}?", [PAIRS]), ("Compare {} and {}.", [PAIRS]),
    ("Give me a recipe for {}.", [DISHES]), ("How do I make {}?", [DISHES]),
    ("Write an email {}.", [EMAILS]), ("Write a short message {}.", [EMAILS]),
    ("Give me five ideas for {}.", [IDEAS]), ("What are some ideas for {}?", [IDEAS]),
    ("{}", [WHYS]),
    ("How does {} work?", [THINGS]), ("Explain how {} works in simple terms.", [THINGS]),
    ("What is {} and why is it useful?", [THINGS]),
    ("How do I write code that {} in {}?", [CODE_TASKS, LANGS]), ("Can you explain {} with a simple example?", [CONCEPTS]),
    ("Plan a three-day trip to {}.", [PLACES]), ("What are the best things to do in {}?", [PLACES]),
    ("Tell me about the history of {}.", [PLACES]), ("Summarize the plot of {}.", [WORKS]),
    ("What are the main themes of {}?", [WORKS]), ("What were the main causes of {}?", [EVENTS]),
    ("Explain {} in a few paragraphs.", [EVENTS]), ("What are the health benefits of {}?", [FOODS]),
    ("What should I consider when buying {}?", [ITEMS]), ("Give me a weekly workout plan for {}.", [GOALS]),
    ("Translate '{}' into {}.", [PHRASES, LANGUAGES]), ("Write {} for a friend's birthday.", [FORMS]),
]


def _fill(template: str, fillers: list) -> list[str]:
    if len(fillers) == 1:
        return [template.format(*(f if isinstance(f, tuple) else (f,))) for f in fillers[0]]
    return [template.format(a, b) for a in fillers[0] for b in fillers[1]]


def chat_prompts(n: int | None = None, seed: int = 0) -> list[str]:
    """The templates x fillers, deduplicated and shuffled; n cycles/cuts the list (None = all of them)."""
    out = list(dict.fromkeys(t for template, fillers in TEMPLATES for t in _fill(template, fillers)))
    random.Random(seed).shuffle(out)
    if n is None:
        return out
    return [out[i % len(out)] for i in range(n)]

"""The docs stay true to the tree: README.md and docs/*.md against the files, the programs' --help
and the scripts' flags. Every relative link resolves (anchors included), every flag the docs name
exists, every flag of the two programs is documented in docs/programs.md, every command in a sh
block names a program or script that exists, and --help gives one line per flag with its default."""
import functools
import glob
import os
import re
import shlex
import subprocess
import unittest

SOURCE = os.environ.get("HARNESS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BINARY = os.environ.get("HARNESS_BINARY_DIR", os.path.join(SOURCE, "build"))
PROGRAMS = ("run_data_parallel", "run_pipeline")
TOOLS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(SOURCE, "apps", "*.cpp")))

# Flags of the outside tools the docs show around the programs (launchers, CTest, the hub's CLI).
OUTSIDE_FLAGS = {
    "torchrun": {"nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port", "no-python",
                 "max-restarts", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "standalone"},
    "srun": {"ntasks-per-node", "ntasks", "nodes", "kill-on-bad-exit", "gres", "cpus-per-task"},
    "sbatch": {"requeue", "nodes", "ntasks-per-node", "gres"},
    "ctest": {"output-on-failure", "timeout", "test-dir", "verbose", "parallel", "label-regex"},
    "huggingface-cli": {"local-dir"},
    ".venv/bin/tensorboard": {"logdir", "port", "bind_all"},
    "cmake": {"build", "target", "parallel"},
    "git": {"oneline"},
}
# What may start a command line in a sh block besides the project's programs and scripts.
OUTSIDE_COMMANDS = set(OUTSIDE_FLAGS) | {"export", "cd"}
WRAPPERS = {"torchrun", "srun"}   # they run a project program named later on the line

FLAG = re.compile(r"(?<![\w/-])--([A-Za-z][\w-]*)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```(\S*)\s*$")


def doc_files():
    return [os.path.join(SOURCE, "README.md")] + sorted(glob.glob(os.path.join(SOURCE, "docs", "*.md")))


def rel(path):
    return os.path.relpath(path, SOURCE)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def split_blocks(text):
    """(prose lines, [(language, first line number, lines)]) of a markdown text."""
    prose, blocks, block = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if block is None and m:
            block = (m.group(1), number + 1, [])
        elif block is not None and line.strip() == "```":
            blocks.append(block)
            block = None
        elif block is not None:
            block[2].append(line)
        else:
            prose.append((number, line))
    if block is not None:
        raise AssertionError(f"a code block opened at line {block[1] - 1} is never closed")
    return prose, blocks


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path):
    seen, out = {}, set()
    prose, _ = split_blocks(read(path))
    for _, line in prose:
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


def help_text(program):
    path = os.path.join(BINARY, program)
    if not os.access(path, os.X_OK):
        raise AssertionError(f"{path} is not built (scripts/build.sh builds every program)")
    proc = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise AssertionError(f"{program} --help exited {proc.returncode}: {proc.stderr}")
    return proc.stdout


def help_flags(text):
    return set(re.findall(r"^\s+(?:-\w, )?--([\w-]+)", text, re.M))


def script_flags(path):
    """The flags a script of scripts/ accepts, read from its argparse calls or its case patterns."""
    text = read(path)
    flags = set()
    for call in re.finditer(r"add_argument\(\s*((?:\"-[^\"]*\"\s*,\s*)+)", text):
        flags |= set(re.findall(r"\"--([\w-]+)\"", call.group(1)))
    if path.endswith(".sh"):
        flags |= set(re.findall(r"^\s*(?:-\w\|)?--([\w-]+)\)", text, re.M))
    if flags or "argparse" in text:
        flags.add("help")
    return flags


def readme_section(title):
    """The text of README's '## {title}' section, up to the next '## ' heading."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", read(os.path.join(SOURCE, "README.md")), re.S | re.M)
    if not m:
        raise AssertionError(f"README.md has no '## {title}' section")
    return m.group(1)


def sh_commands(text):
    """[(the prose since the previous block, [command, ...])] of each sh block of a markdown text,
    with continued lines joined and comments dropped."""
    out, lines, prose = [], text.splitlines(), ""
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```sh":
            prose += lines[i] + "\n"
            i += 1
            continue
        commands, pending = [], ""
        i += 1
        while lines[i].strip() != "```":
            line = lines[i].rstrip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
            else:
                command = (pending + line).strip()
                pending = ""
                if command and not command.startswith("#"):
                    commands.append(command)
            i += 1
        out.append((prose, commands))
        prose = ""
        i += 1
    return out


def with_flags(words, settings):
    """The words of a command with each --flag of settings set to its value (replaced where given,
    appended where not); a value of None is a bare switch."""
    words = list(words)
    for flag, value in settings.items():
        if flag in words:
            at = words.index(flag)
            if value is not None:
                words[at + 1] = value
        else:
            words += [flag] if value is None else [flag, value]
    return words


class QuickStart(unittest.TestCase):
    """README's Quick start as a new user runs it: after scripts/run.sh, every command shown works."""

    def test_every_program_of_the_quick_start_is_built_by_scripts_run_sh(self):
        shown = set()
        for _, commands in sh_commands(readme_section("Quick start")):
            for command in commands:
                shown |= set(re.findall(r"(?<![\w/])build/([\w-]+)", command))
        self.assertIn("run_pipeline", shown)
        m = re.search(r"scripts/build\.sh\"?((?: [\w-]+)+)", read(os.path.join(SOURCE, "scripts", "run.sh")))
        self.assertIsNotNone(m, "scripts/run.sh does not call scripts/build.sh with its targets")
        built = set(m.group(1).split())
        self.assertEqual(sorted(shown - built), [],
                         "README's Quick start runs programs that scripts/run.sh does not build")

    def test_the_cpu_quick_start_runs_as_printed_for_one_batch(self):
        blocks = sh_commands(readme_section("Quick start"))
        self.assertTrue(blocks and "On CPUs" in blocks[0][0], "the Quick start opens with its CPU block")
        commands = blocks[0][1]
        self.assertGreaterEqual(len(commands), 3)
        import tempfile
        # In order, from one folder, with the work directories as printed: a command that would
        # start over an earlier one's checkpoints is refused, as it would be for a user.
        with tempfile.TemporaryDirectory() as cwd:
            for command in commands:
                words = shlex.split(command, comments=True)
                m = re.match(r"^build/([\w-]+)$", words[0])
                self.assertIsNotNone(m, command)
                args = with_flags([os.path.join(BINARY, m.group(1))] + words[1:], {
                    "--n_epochs": "1", "--max_batches": "1", "--train_size": "128", "--validation_size": "8",
                    "--test_size": "2", "--no_progress": None})
                with self.subTest(command=command):
                    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=cwd)
                    self.assertEqual(proc.returncode, 0, f"{' '.join(args)}\n{proc.stdout}\n{proc.stderr}")
                    if "--memory_plan" in words:
                        self.assertIn("model state per rank: at most", proc.stdout)
                    else:
                        self.assertRegex(proc.stdout, r"(?m)^Epoch 0( on Rank 0)?: BLEU = \d", proc.stdout)

    def test_a_test_count_is_written_in_one_place_only(self):
        counts = [f"{rel(page)}:{number}: {m}" for page in doc_files()
                  for number, line in enumerate(read(page).splitlines(), 1)
                  for m in re.findall(r"\b\d[\d,]* tests\b", line)]
        self.assertLessEqual(len(counts), 1, "the suite's size is written in more than one place "
                                             "(keep it in docs/tests.md only):\n" + "\n".join(counts))

    def test_the_build_page_lists_every_program(self):
        row = next((line for line in read(os.path.join(SOURCE, "docs", "tests.md")).splitlines()
                    if line.startswith("| `build/<program>`")), "")
        self.assertEqual([t for t in TOOLS if f"`{t}`" not in row], [],
                         "docs/tests.md's `build/<program>` row misses programs of apps/")


class Docs(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.help = {tool: help_text(tool) for tool in TOOLS}
        cls.flags = {tool: help_flags(text) for tool, text in cls.help.items()}
        cls.script_flags = {rel(p): script_flags(p) for p in glob.glob(os.path.join(SOURCE, "scripts", "*"))
                            if os.path.isfile(p)}   # not scripts/__pycache__
        # scripts/run.sh hands its arguments to run_data_parallel, scripts/test.sh to ctest.
        cls.script_flags["scripts/run.sh"] = cls.flags["run_data_parallel"]
        cls.script_flags["scripts/test.sh"] = OUTSIDE_FLAGS["ctest"]
        cls.all_flags = set().union(*cls.flags.values(), *cls.script_flags.values(), *OUTSIDE_FLAGS.values())

    def test_the_pages_exist_and_each_starts_with_when_to_use_it_and_a_command(self):
        pages = sorted(os.path.basename(p) for p in glob.glob(os.path.join(SOURCE, "docs", "*.md")))
        for needed in ("programs.md", "outputs.md", "data-parallel.md", "pipeline.md", "tensor-parallel-3d.md",
                       "zero.md", "checkpoints-faults.md", "data-models.md", "performance.md", "tests.md",
                       "gpu-check.md"):
            self.assertIn(needed, pages)
        for page in doc_files()[1:]:
            text = read(page)
            self.assertTrue(text.startswith("# "), f"{rel(page)}: starts with a '# ' title")
            head = text[:2500]
            self.assertIn("**When to use this.**", head, f"{rel(page)}: no '**When to use this.**' near the top")
            self.assertRegex(head, r"```sh\n", f"{rel(page)}: no runnable command (a sh block) near the top")

    def test_readme_is_read_in_five_minutes(self):
        lines = read(os.path.join(SOURCE, "README.md")).splitlines()
        self.assertLessEqual(len(lines), 180, "README.md grew past 180 lines: move the detail into docs/")
        for page in doc_files()[1:]:
            self.assertIn(f"(docs/{os.path.basename(page)}", "\n".join(lines),
                          f"README.md does not link {rel(page)}")

    def test_every_relative_link_resolves(self):
        problems = []
        for page in doc_files():
            prose, _ = split_blocks(read(page))
            for number, line in prose:
                for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                    if re.match(r"^[a-z]+:", target):
                        continue
                    path, _, anchor = target.partition("#")
                    resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
                    where = f"{rel(page)}:{number}: ({target})"
                    if not os.path.exists(resolved):
                        problems.append(f"{where}: {rel(resolved)} does not exist")
                    elif anchor and (not resolved.endswith(".md") or anchor not in anchors(resolved)):
                        problems.append(f"{where}: no heading with the anchor #{anchor} in {rel(resolved)}")
        self.assertEqual(problems, [], "\n".join(problems))

    def test_every_flag_the_docs_name_exists(self):
        problems = []
        for page in doc_files():
            for number, line in enumerate(read(page).splitlines(), 1):
                for flag in FLAG.findall(line):
                    if flag not in self.all_flags:
                        problems.append(f"{rel(page)}:{number}: --{flag} is no flag of a program, a script or "
                                        f"a launcher the docs show")
        self.assertEqual(problems, [], "\n".join(problems))

    def test_every_flag_of_the_programs_is_documented_in_the_programs_page(self):
        page = read(os.path.join(SOURCE, "docs", "programs.md"))
        documented = set(FLAG.findall(page))
        for program in PROGRAMS:
            missing = sorted(self.flags[program] - documented - {"help"})
            self.assertEqual(missing, [], f"flags of {program} --help missing from docs/programs.md")

    def test_help_is_one_line_per_flag_with_its_default(self):
        for program in PROGRAMS:
            text = self.help[program]
            lines = text.splitlines()
            self.assertTrue(lines[0].startswith(f"Usage: {program}"), lines[0])
            flag_lines = [line for line in lines if line.startswith("  -")]
            self.assertEqual(len(flag_lines), len(self.flags[program]), f"{program} --help:\n{text}")
            for line in lines[1:]:
                self.assertFalse(line.startswith(" ") and not line.startswith("  -"),
                                 f"{program} --help continues a flag on a second line: {line!r}")
                self.assertLessEqual(len(line), 130, f"{program} --help: a line of {len(line)} characters: {line!r}")
            for line in flag_lines:
                if "--help" not in line:
                    self.assertIn("(default: ", line, f"{program} --help names no default: {line!r}")

    def check_command(self, command, where):
        """Problems with one command line of a sh block."""
        try:
            words = shlex.split(command, comments=True)
        except ValueError as e:
            return [f"{where}: cannot split {command!r}: {e}"]
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words.pop(0)   # environment assignments
        if not words:
            return []
        first, problems = words[0], []
        if first.startswith("scripts/") and first.endswith(".py"):
            return [f"{where}: {first} needs an interpreter: .venv/bin/python (which has torch) or python3"]
        if first in (".venv/bin/python", "python3", "python"):
            if len(words) < 2 or not words[1].startswith("scripts/"):
                return [f"{where}: {first} runs something other than a script of scripts/: {command!r}"]
            words = words[1:]
            first = words[0]
        project = [i for i, w in enumerate(words) if re.match(r"^(build|scripts)/", w)]
        if first in WRAPPERS:
            if not project:
                return [f"{where}: {first} runs no program of the project: {command!r}"]
            outside, words = set(w[2:] for w in words[:project[0]] if w.startswith("--")), words[project[0]:]
            problems += [f"{where}: --{f} is no {first} flag the docs expect" for f in
                         sorted(f.split("=")[0] for f in outside) if f not in OUTSIDE_FLAGS[first]]
            first = words[0]
        if first in OUTSIDE_COMMANDS:
            known = OUTSIDE_FLAGS.get(first, set())
            return problems + [f"{where}: --{f} is no {first} flag the docs expect"
                               for f in sorted(w[2:].split("=")[0] for w in words[1:] if w.startswith("--"))
                               if f not in known]
        flags = None
        m = re.match(r"^build/(tests/)?([\w-]+)$", first)
        if m and m.group(1):
            if not os.path.isdir(os.path.join(SOURCE, "tests", m.group(2).removesuffix("_tests"))):
                problems.append(f"{where}: {first} is no test suite of tests/")
            flags = set()   # GoogleTest's own flags are not checked
        elif m:
            if m.group(2) not in TOOLS:
                return problems + [f"{where}: {first} is no program of apps/"]
            flags = self.flags[m.group(2)]
        elif first.startswith("scripts/"):
            if not os.path.isfile(os.path.join(SOURCE, first)):
                return problems + [f"{where}: {first} does not exist"]
            flags = self.script_flags.get(first, set())
        else:
            return problems + [f"{where}: {first!r} is no program or script of the project: {command!r}"]
        if flags:
            for word in words[1:]:
                if word.startswith("--") and word[2:].split("=")[0] not in flags:
                    problems.append(f"{where}: {first} has no flag {word.split('=')[0]}")
        return problems

    def test_every_command_in_a_sh_block_names_a_program_or_script_that_exists(self):
        problems, commands = [], 0
        for page in doc_files():
            _, blocks = split_blocks(read(page))
            for language, start, lines in blocks:
                if language == "":
                    problems.append(f"{rel(page)}:{start - 1}: a code block without a language (sh, text, ...)")
                if language not in ("sh", "bash", "shell"):
                    continue
                pending, first = "", start
                for offset, line in enumerate(lines):
                    line = re.sub(r"^\$ ", "", line) if not pending else line
                    if not pending:
                        first = start + offset
                    if line.rstrip().endswith("\\"):
                        pending += line.rstrip()[:-1] + " "
                        continue
                    command, pending = pending + line, ""
                    if command.strip() and not command.strip().startswith("#"):
                        commands += 1
                        problems += self.check_command(command, f"{rel(page)}:{first}")
        self.assertGreater(commands, 20)
        self.assertEqual(problems, [], "\n".join(problems))

    def test_the_checker_itself_catches_what_it_must(self):
        where = "x.md:1"
        self.assertEqual(self.check_command("build/run_data_parallel --world_size 2 --zero_stage 1", where), [])
        self.assertEqual(self.check_command("MKL_CBWR=COMPATIBLE scripts/test.sh -R pipeline", where), [])
        self.assertEqual(self.check_command(
            "torchrun --nnodes 2 --nproc_per_node 8 --no-python build/run_data_parallel --batch_size 8", where), [])
        self.assertTrue(self.check_command("build/run_data_parallel --zero-stage 1", where))
        self.assertTrue(self.check_command("build/no_such_program --help", where))
        self.assertTrue(self.check_command(".venv/bin/python scripts/no_such.py", where))
        self.assertTrue(self.check_command("rm -rf build", where))
        self.assertTrue(self.check_command("scripts/plot_metrics.py metrics.jsonl", where))
        self.assertTrue(self.check_command("torchrun --nnodes 2 python train.py", where))
        self.assertEqual(slug("ZeRO's memory and speed"), "zeros-memory-and-speed")
        self.assertEqual(slug("Memory plan (`--memory_plan`)"), "memory-plan---memory_plan")


# The tour of the code (docs/architecture.md): the paths and symbols it names, in backticks.
ARCHITECTURE = os.path.join(SOURCE, "docs", "architecture.md")
CODE_PATH = re.compile(r"^(?:src|include|apps|tests|scripts|docs|cmake)(?:/[\w.-]+)*/?$|^[\w.-]+\.(?:txt|md)$")
SYMBOL = re.compile(r"^(?:harness::)?((?:\w+::)+)(~?\w+)$")


@functools.lru_cache(maxsize=None)
def code_files():
    """Every header and source of the library, relative path -> text."""
    files = {}
    for pattern in ("include/**/*.h", "src/**/*.h", "src/**/*.cpp"):
        for path in glob.glob(os.path.join(SOURCE, pattern), recursive=True):
            files[rel(path)] = read(path)
    return files


def declares(text, name):
    """Whether `text` declares `name` as a type, an alias or a function (a definition or a declaration)."""
    return re.search(r"\b(?:class|struct|enum class|using)\s+%s\b|\b%s\s*\(" % (name, name), text) is not None


def symbol_problem(symbol):
    """Why `symbol` (namespace::Name or Class::member, harness:: optional) names nothing, or None."""
    m = SYMBOL.match(symbol)
    qualifiers, name = m.group(1).rstrip(":").split("::"), m.group(2)
    for path, text in code_files().items():
        if not declares(text, name):
            continue
        outer = qualifiers[-1]
        in_namespace = re.search(r"namespace harness(?:::\w+)*::%s\b" % outer, text)
        in_class = re.search(r"\b(?:class|struct)\s+%s\b" % outer, text) or ("%s::%s" % (outer, name)) in text
        if in_namespace or in_class:
            return None
    return f"`{symbol}`: no header or source declares {name} in {'::'.join(qualifiers)}"


def architecture_problems(text):
    problems = []
    for token in re.findall(r"`([^`\n]+)`", text):
        if CODE_PATH.match(token) and not os.path.exists(os.path.join(SOURCE, token)):
            problems.append(f"`{token}`: no such file or folder")
        elif SYMBOL.match(token):
            problem = symbol_problem(token)
            if problem:
                problems.append(problem)
    return problems


class Architecture(unittest.TestCase):
    def test_every_path_and_symbol_it_names_exists(self):
        text = read(ARCHITECTURE)
        self.assertGreater(len(re.findall(r"`[^`\n]+::[^`\n]+`", text)), 20, "the tour names the code's symbols")
        self.assertEqual(architecture_problems(text), [])

    def test_every_folder_of_the_library_has_its_paragraph(self):
        text = read(ARCHITECTURE)
        for folder in sorted(os.listdir(os.path.join(SOURCE, "src"))):
            self.assertIn(f"`src/{folder}/`", text, f"src/{folder}/ is not toured")
        for folder in sorted(os.listdir(os.path.join(SOURCE, "src", "train"))):
            if os.path.isdir(os.path.join(SOURCE, "src", "train", folder)):
                self.assertIn(f"`src/train/{folder}/`", text, f"src/train/{folder}/ is not toured")

    def test_the_checker_catches_a_moved_file_or_a_renamed_symbol(self):
        self.assertEqual(architecture_problems("`src/train/step/build_step.cpp` `train::build_step` "
                                               "`GPT2TrainStep::step` `harness::parallel::Layout`"), [])
        self.assertEqual(len(architecture_problems("`src/train/compose_step.cpp` `train::compose_steps` "
                                                   "`GPT2TrainStep::stepp` `zero::build_step`")), 4)


if __name__ == "__main__":
    unittest.main()

// --help of every program: a usage line, one sentence on what it does, then one line per flag
// with its value's name and default. The detail of each flag is in docs/programs.md.
#pragma once

#include <cxxopts.hpp>

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

namespace harness::apps {

// One option's line: "  --name ARG   meaning (default: X)". Switches are off by default; an
// option whose default is worked out at run time (an empty string here) says so in its meaning.
inline std::string flag_line(const cxxopts::HelpOptionDetails& o, size_t name_width) {
  // A switch is a boolean without a value's name; --pytest, a boolean that takes True|False, has one.
  const bool is_switch = o.is_boolean && o.arg_help.empty();
  std::string name = "--" + o.l.front();
  if (!o.s.empty()) name = "-" + o.s + ", " + name;
  if (!is_switch) {
    const std::string arg = o.arg_help.empty() ? "ARG" : o.arg_help;
    name += o.has_implicit ? " [" + arg + "]" : " " + arg;
  }
  std::string meaning = o.desc;
  if (meaning.find("(default: ") != std::string::npos || o.l.front() == "help") {
    // The default is worked out at run time and said in words, or there is none.
  } else if (is_switch) {
    meaning += " (default: off)";
  } else if (o.has_default && !o.default_value.empty()) {
    meaning += " (default: " + o.default_value + ")";
  }
  name.resize(std::max(name.size(), name_width), ' ');
  return "  " + name + "  " + meaning + "\n";
}

inline std::string one_line_help(const cxxopts::Options& options, const std::string& what) {
  std::vector<const cxxopts::HelpOptionDetails*> all;
  for (const std::string& group : options.groups()) {
    for (const cxxopts::HelpOptionDetails& o : options.group_help(group).options) all.push_back(&o);
  }
  size_t width = 0;
  for (const auto* o : all) {
    const std::string line = flag_line(*o, 0);
    width = std::max(width, line.find("  ", 2) - 2);
  }
  std::string out = "Usage: " + options.program() + " [--flag value ...]\n" + what + "\n\n";
  for (const auto* o : all) out += flag_line(*o, width);
  return out;
}

}  // namespace harness::apps

// --help of every program: a usage line, one sentence on what it does, then one line per flag
// with its value's name and default. The detail of each flag is in docs/programs.md.
#pragma once

#include <cxxopts.hpp>

#include <algorithm>
#include <string>
#include <vector>

namespace harness::apps {

// A switch is a boolean without a value's name; --pytest, a boolean that takes True|False, has one.
inline bool is_switch(const cxxopts::HelpOptionDetails& o) { return o.is_boolean && o.arg_help.empty(); }

// "--name ARG", "-h, --help", "--pytest [True|False]".
inline std::string flag_name(const cxxopts::HelpOptionDetails& o) {
  std::string name = "--" + o.l.front();
  if (!o.s.empty()) name = "-" + o.s + ", " + name;
  if (!is_switch(o)) {
    const std::string arg = o.arg_help.empty() ? "ARG" : o.arg_help;
    name += o.has_implicit ? " [" + arg + "]" : " " + arg;
  }
  return name;
}

// The meaning with its default. Switches are off by default; an option whose default is worked
// out at run time (an empty string here) says so in its meaning.
inline std::string flag_meaning(const cxxopts::HelpOptionDetails& o) {
  if (o.desc.find("(default: ") != std::string::npos || o.l.front() == "help") return o.desc;
  if (is_switch(o)) return o.desc + " (default: off)";
  if (o.has_default && !o.default_value.empty()) return o.desc + " (default: " + o.default_value + ")";
  return o.desc;
}

inline std::string one_line_help(const cxxopts::Options& options, const std::string& what) {
  std::vector<const cxxopts::HelpOptionDetails*> all;
  for (const std::string& group : options.groups()) {
    for (const cxxopts::HelpOptionDetails& o : options.group_help(group).options) all.push_back(&o);
  }
  size_t width = 0;
  for (const auto* o : all) width = std::max(width, flag_name(*o).size());
  std::string out = "Usage: " + options.program() + " [--flag value ...]\n" + what + "\n\n";
  for (const auto* o : all) {
    std::string name = flag_name(*o);
    name.resize(width, ' ');
    out += "  " + name + "  " + flag_meaning(*o) + "\n";
  }
  return out;
}

}  // namespace harness::apps

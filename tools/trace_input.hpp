// SPDX-License-Identifier: Apache-2.0
// The bytes of a trace, read as a stream, so that a reader holds what it builds and not the
// file's text: a 718 MB Kineto trace read whole took 0.79 GB, most of it the text.
#pragma once

#include <cstddef>
#include <fstream>
#include <ios>
#include <istream>
#include <memory>
#include <streambuf>
#include <string>
#include <string_view>
#include <vector>

namespace terrace::tools {

// A read-only stream over bytes held elsewhere, without copying them.
class view_istream : public std::istream {
 public:
  explicit view_istream(std::string_view bytes);

 private:
  class buffer : public std::streambuf {
   public:
    explicit buffer(std::string_view bytes);
  };
  buffer buffer_;
};

// What the start of a text trace says about its format.
struct first_line_facts {
  bool names_action = false;  // `"action"` appears in the first line (blank lines before it skipped)
  bool more_lines = false;    // something other than white space follows the first line
};

// A trace to be read once or more from its start. A regular file is streamed through a large
// buffer; anything else (a pipe) cannot be read twice, so it is read into memory once.
class trace_input {
 public:
  static constexpr std::size_t kHeadBytes = std::size_t{1} << 16;

  // @throws terrace::logic_error when `path` cannot be opened or read.
  explicit trace_input(const std::string& path);
  trace_input(const trace_input&) = delete;
  trace_input& operator=(const trace_input&) = delete;

  const std::string& path() const { return path_; }
  // Up to the first kHeadBytes bytes.
  std::string_view head() const { return head_; }
  // A stream over the whole input at its first byte; each call starts again and invalidates
  // the stream an earlier call returned. A read error in it throws std::ios_base::failure.
  std::istream& from_start();
  // The whole input in memory, kept by this object, for a reader that needs it so (the
  // unpickler, whose tree is many times the size of its input anyway).
  std::string_view all();
  // Reads through the first line and a little past it.
  first_line_facts first_line();

 private:
  std::string path_;
  std::string head_;
  bool regular_ = false;
  std::vector<char> file_buffer_;  // the file stream's buffer, large for fewer reads
  std::ifstream file_;
  std::string text_;  // all of the input, once all() or a non-regular input asked for it
  bool have_text_ = false;
  std::unique_ptr<view_istream> view_;  // over text_, for a non-regular input
};

[[noreturn]] void throw_read_error(const std::string& path, const std::ios_base::failure& e);

// Turns a read error while `read` runs into a terrace::logic_error naming `path`, as an error
// opening it is.
template <class F>
auto reading(const std::string& path, F&& read) {
  try {
    return read();
  } catch (const std::ios_base::failure& e) {
    throw_read_error(path, e);
  }
}

}  // namespace terrace::tools

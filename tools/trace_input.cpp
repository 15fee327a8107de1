// SPDX-License-Identifier: Apache-2.0
#include "tools/trace_input.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iterator>

#include "terrace/error.hpp"

namespace terrace::tools {

view_istream::buffer::buffer(std::string_view bytes) {
  // The get area is only read: istream never writes through it.
  char* begin = const_cast<char*>(bytes.data());
  setg(begin, begin, begin + bytes.size());
}

view_istream::view_istream(std::string_view bytes) : std::istream(nullptr), buffer_(bytes) {
  rdbuf(&buffer_);
}

void throw_read_error(const std::string& path, const std::ios_base::failure& e) {
  // The system's reason ("Is a directory", "Input/output error") when the failure has one.
  const std::error_code& code = e.code();
  const std::string why = code && code != std::io_errc::stream ? code.message() : e.what();
  throw logic_error("cannot read trace '" + path + "': " + why);
}

trace_input::trace_input(const std::string& path) : path_(path) {
  // "-" is standard input, as the trace generator's default output is standard output.
  const std::string file = path == "-" ? "/dev/stdin" : path;
  std::error_code ec;
  regular_ = std::filesystem::is_regular_file(file, ec);
  if (regular_) {
    // 1 MiB: the parsers then read from memory, and the kernel sees large sequential reads.
    file_buffer_.resize(std::size_t{1} << 20);
    file_.rdbuf()->pubsetbuf(file_buffer_.data(), static_cast<std::streamsize>(file_buffer_.size()));
  }
  file_.open(file, std::ios::binary);
  if (!file_) throw logic_error("cannot open trace '" + path + "': " + std::strerror(errno));
  // A read error (EIO, or a directory) throws out of whatever reads, rather than looking like
  // the end of the input: a stream cut short at a line's end would be a shorter trace.
  file_.exceptions(std::ios::badbit);
  reading(path_, [&] {
    if (regular_) {
      head_.resize(kHeadBytes);
      file_.read(head_.data(), static_cast<std::streamsize>(head_.size()));
      head_.resize(static_cast<std::size_t>(file_.gcount()));
    } else {
      text_.assign(std::istreambuf_iterator<char>(file_), std::istreambuf_iterator<char>());
      have_text_ = true;
      head_ = text_.substr(0, kHeadBytes);
    }
  });
}

std::istream& trace_input::from_start() {
  if (!regular_) {
    view_ = std::make_unique<view_istream>(text_);
    return *view_;
  }
  file_.clear();
  file_.seekg(0);
  return file_;
}

std::string_view trace_input::all() {
  if (!have_text_) {
    reading(path_, [&] {
      std::istream& in = from_start();
      in.seekg(0, std::ios::end);
      const std::streamoff size = in.tellg();
      text_.resize(static_cast<std::size_t>(std::max<std::streamoff>(size, 0)));
      in.seekg(0);
      in.read(text_.data(), static_cast<std::streamsize>(text_.size()));
      // A file that shrank meanwhile is read as far as it goes.
      text_.resize(static_cast<std::size_t>(in.gcount()));
    });
    have_text_ = true;
  }
  return text_;
}

first_line_facts trace_input::first_line() {
  constexpr std::string_view kAction = "\"action\"";
  first_line_facts facts;
  return reading(path_, [&] {
    std::istream& in = from_start();
    std::vector<char> chunk(std::size_t{1} << 16);
    std::string tail;  // the first line's last bytes so far, for a name split between chunks
    bool in_first_line = true;
    bool started = false;  // blank lines before the first text are not the first line
    while (true) {
      in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
      std::string_view bytes(chunk.data(), static_cast<std::size_t>(in.gcount()));
      if (bytes.empty()) return facts;
      if (!started) {
        const std::size_t text = bytes.find_first_not_of(" \t\r\n");
        if (text == std::string_view::npos) continue;
        bytes.remove_prefix(text);
        started = true;
      }
      if (in_first_line) {
        const std::size_t newline = bytes.find('\n');
        const std::string_view part = bytes.substr(0, newline);
        if (!facts.names_action) {
          std::string across = tail;  // the last chunk's end and this one's start
          across += part.substr(0, kAction.size() - 1);
          facts.names_action = across.find(kAction) != std::string::npos ||
                               part.find(kAction) != std::string_view::npos;
          tail += part.substr(part.size() - std::min(part.size(), kAction.size() - 1));
          if (tail.size() >= kAction.size()) tail.erase(0, tail.size() - (kAction.size() - 1));
        }
        if (newline == std::string_view::npos) continue;
        in_first_line = false;
        bytes.remove_prefix(newline + 1);
      }
      if (bytes.find_first_not_of(" \t\r\n") != std::string_view::npos) {
        facts.more_lines = true;
        return facts;
      }
    }
  });
}

}  // namespace terrace::tools

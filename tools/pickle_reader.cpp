// SPDX-License-Identifier: Apache-2.0
// The pickle virtual machine for plain data only. Containers are shared (memoised lists and dicts
// are mutated after MEMOIZE), so the machine keeps a graph of values and walks it at STOP, handing
// each value to the consumer as SAX events.
//
// A value is 8 bytes: a snapshot pickle refers to each shared stack frame again with a 2-5 byte
// BINGET, so a list of references is most of the graph (60 frames per event), and the graph's
// size per input byte is what a large snapshot costs. Strings stay in the input (string_view);
// containers are indices into one table, so cycles and deep nesting need no special teardown.
//
// The input is hostile until proven otherwise, and a few bytes of pickle can describe a lot:
//   - nesting one level per byte (`]` 300 000 times, then APPENDs), or a cycle (a memoised list
//     appended to itself): the walk refuses more than kMaxDepth levels;
//   - sharing nested in sharing (x_k = [x_{k-1}, x_{k-1}]: 2^40 values from 689 bytes): the walk
//     hands over every share, so it stops at a budget proportional to the input's size.
// Everything else the machine holds grows at most one value per input byte (every push consumes
// at least one opcode byte), and the stack is capped besides.
#include "tools/pickle_reader.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "terrace/error.hpp"
#include "tools/json_sax.hpp"

namespace terrace::tools {

namespace {

using sax = nlohmann::json_sax<nlohmann::json>;

constexpr int kMaxDepth = 200;

// A 3-bit kind and a 61-bit payload: an atom's code, an integer that fits, or an index into the
// machine's table of that kind.
class value {
 public:
  enum kind : std::uint8_t { atom, small_int, big_int, real, text, list, dict };
  enum atom_code : std::uint64_t { none, false_, true_, mark, unset };

  value() : value(atom, unset) {}
  value(kind k, std::uint64_t payload) : bits_(payload << 3 | k) {}
  static bool fits_small(std::int64_t v) { return v >= -(std::int64_t{1} << 60) && v < (std::int64_t{1} << 60); }
  static value small(std::int64_t v) { return value(small_int, static_cast<std::uint64_t>(v)); }

  [[nodiscard]] kind k() const { return static_cast<kind>(bits_ & 7); }
  [[nodiscard]] std::uint64_t payload() const { return bits_ >> 3; }
  [[nodiscard]] std::int64_t small_value() const { return static_cast<std::int64_t>(bits_) >> 3; }
  [[nodiscard]] bool is(atom_code c) const { return k() == atom && payload() == c; }
  [[nodiscard]] bool is_container() const { return k() == list || k() == dict; }

 private:
  std::uint64_t bits_;
};
static_assert(sizeof(value) == 8);

struct container {
  std::vector<value> items;  // a dict's are key, value, key, value, ...
};

// Why each refused opcode is refused: it names or calls Python code, or refers to objects outside
// the stream.
const char* refused(std::uint8_t op) {
  switch (op) {
    case 'c': return "GLOBAL (imports a Python object)";
    case 0x93: return "STACK_GLOBAL (imports a Python object)";
    case 'R': return "REDUCE (calls a Python callable)";
    case 'b': return "BUILD (calls __setstate__)";
    case 'i': return "INST (instantiates a class)";
    case 'o': return "OBJ (instantiates a class)";
    case 0x81: return "NEWOBJ (instantiates a class)";
    case 0x92: return "NEWOBJ_EX (instantiates a class)";
    case 0x82: case 0x83: case 0x84: return "EXT (imports a registered object)";
    case 'P': case 'Q': return "PERSID (a persistent reference)";
    case 0x97: return "NEXT_BUFFER (an out-of-band buffer)";
    default: return nullptr;
  }
}

class machine {
 public:
  machine(std::string_view data, const std::string& source)
      : d_(data),
        source_(source),
        // Sharing is legal and common (PyTorch's snapshots refer to each repeated string and
        // frame dict again with a 2-5 byte BINGET, which expands to up to 7 values and ~100 bytes
        // of text), so the budget is generous per input byte, with a floor for small files; what
        // a real snapshot never does is double its size at every level.
        max_values_(std::max<std::size_t>(16 * data.size(), std::size_t{1} << 20)),
        max_text_(std::max<std::size_t>(256 * data.size(), std::size_t{1} << 28)) {}

  void run(sax& out) {
    while (true) {
      if (pos_ >= d_.size()) fail("the stream ends without STOP");
      const std::size_t at = pos_;
      const auto op = static_cast<std::uint8_t>(d_[pos_++]);
      op_at_ = at;
      if (const char* why = refused(op)) {
        fail("refused opcode " + hex(op) + " " + why + ": only plain data is read");
      }
      switch (op) {
        case 0x80: take(1); break;  // PROTO
        case 0x95: take(8); break;  // FRAME: framing only
        case '.':                   // STOP
          emit(pop(), 0, out);
          return;
        case 'N': push(value(value::atom, value::none)); break;
        case 0x88: push(value(value::atom, value::true_)); break;
        case 0x89: push(value(value::atom, value::false_)); break;
        case 'J': push_int(static_cast<std::int32_t>(le(4))); break;
        case 'K': push_int(static_cast<std::int64_t>(le(1))); break;
        case 'M': push_int(static_cast<std::int64_t>(le(2))); break;
        case 0x8a: push_long(le(1)); break;
        case 0x8b: push_long(le(4)); break;
        case 'G': {
          std::uint64_t bits = 0;
          const char* p = take(8);
          for (int k = 0; k < 8; ++k) bits = (bits << 8) | static_cast<std::uint8_t>(p[k]);
          double f = 0.0;
          std::memcpy(&f, &bits, sizeof bits);
          push(value(value::real, reals_.size()));
          reals_.push_back(f);
          break;
        }
        case 0x8c: case 'C': push_text(le(1)); break;
        case 'X': case 'B': push_text(le(4)); break;
        case 0x8d: case 0x8e: push_text(le(8)); break;
        case '}': push(make_container(value::dict, {})); break;
        case ']': case ')': case 0x8f: push(make_container(value::list, {})); break;
        case '(': push(value(value::atom, value::mark)); break;
        case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
          std::vector<value> items(op - 0x84u);
          for (std::size_t k = items.size(); k-- > 0;) items[k] = pop();
          push(make_container(value::list, std::move(items)));
          break;
        }
        case 't': case 0x91: case 'l':  // TUPLE, FROZENSET, LIST
          push(make_container(value::list, pop_to_mark()));
          break;
        case 'd': {  // DICT
          auto items = pop_to_mark();
          check_pairs(items);
          push(make_container(value::dict, std::move(items)));
          break;
        }
        case 0x94: put(memo_size_, top()); break;  // MEMOIZE: at the memo's length
        case 'q': put(le(1), top()); break;
        case 'r': put(le(4), top()); break;
        case 'h': push(get(le(1))); break;
        case 'j': push(get(le(4))); break;
        case 'a': {  // APPEND
          const value v = pop();
          container_at(value::list, "APPEND").items.push_back(v);
          break;
        }
        case 'e': case 0x90: {  // APPENDS, ADDITEMS
          auto items = pop_to_mark();
          auto& c = container_at(value::list, "APPENDS");
          c.items.insert(c.items.end(), items.begin(), items.end());
          break;
        }
        case 's': {  // SETITEM
          const value v = pop();
          const value k = pop();
          auto& c = container_at(value::dict, "SETITEM");
          c.items.push_back(k);
          c.items.push_back(v);
          break;
        }
        case 'u': {  // SETITEMS
          auto items = pop_to_mark();
          check_pairs(items);
          auto& c = container_at(value::dict, "SETITEMS");
          c.items.insert(c.items.end(), items.begin(), items.end());
          break;
        }
        case '0': pop(); break;  // POP
        case '2': push(top()); break;  // DUP
        default: fail("unsupported opcode " + hex(op) + " (not in the plain-data subset)");
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw logic_error(source_ + ": pickle byte " + std::to_string(op_at_) + ": " + why);
  }
  static std::string hex(std::uint8_t op) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "0x%02x", op);
    return buf;
  }
  const char* take(std::size_t n) {
    if (n > d_.size() - pos_) fail("truncated: needs " + std::to_string(n) + " more bytes");
    const char* p = d_.data() + pos_;
    pos_ += n;
    return p;
  }
  std::uint64_t le(std::size_t n) {
    const char* p = take(n);
    std::uint64_t v = 0;
    for (std::size_t k = n; k-- > 0;) v = (v << 8) | static_cast<std::uint8_t>(p[k]);
    return v;
  }

  void push(value v) {
    if (stack_.size() > (1u << 24)) fail("stack too deep");
    stack_.push_back(v);
  }
  void push_int(std::int64_t v) {
    if (value::fits_small(v)) return push(value::small(v));
    push(value(value::big_int, big_ints_.size()));
    big_ints_.push_back(v);
  }
  void push_long(std::uint64_t len) {
    if (len > 8) fail("integer wider than 64 bits");
    const char* p = take(len);
    std::uint64_t v = 0;
    for (std::size_t k = len; k-- > 0;) v = (v << 8) | static_cast<std::uint8_t>(p[k]);
    if (len > 0 && len < 8 && (static_cast<std::uint8_t>(p[len - 1]) & 0x80) != 0) {
      v |= ~std::uint64_t{0} << (8 * len);  // sign-extend two's complement
    }
    push_int(static_cast<std::int64_t>(v));
  }
  void push_text(std::uint64_t len) {
    if (len > d_.size()) fail("string longer than the file");
    const char* p = take(static_cast<std::size_t>(len));
    push(value(value::text, texts_.size()));
    texts_.emplace_back(p, static_cast<std::size_t>(len));
  }
  value make_container(value::kind k, std::vector<value> items) {
    containers_.push_back({std::move(items)});
    return value(k, containers_.size() - 1);
  }

  value top() const {
    if (stack_.empty()) fail("stack underflow");
    return stack_.back();
  }
  value pop() {
    const value v = top();
    stack_.pop_back();
    if (v.is(value::mark)) fail("unexpected MARK");
    return v;
  }
  std::vector<value> pop_to_mark() {
    std::size_t k = stack_.size();
    while (k > 0 && !stack_[k - 1].is(value::mark)) --k;
    if (k == 0) fail("no MARK on the stack");
    std::vector<value> items(stack_.begin() + static_cast<std::ptrdiff_t>(k), stack_.end());
    stack_.resize(k - 1);
    return items;
  }
  container& container_at(value::kind k, const char* op) {
    const value c = top();
    if (c.k() != k) fail(std::string(op) + " on a value of the wrong type");
    return containers_[c.payload()];
  }
  void check_pairs(const std::vector<value>& items) const {
    if (items.size() % 2 != 0) fail("odd number of items for a dict");
  }

  // Python numbers the memo densely (MEMOIZE, or BINPUT of the memo's length); an index far
  // past the end (a hostile LONG_BINPUT of 2^32 - 1) goes to a map instead of growing the table.
  // The table's reach follows the slots set, each one opcode: a reach of the table's end plus a
  // constant let each 5-byte LONG_BINPUT just inside it add that constant again (2^20 slots, 8 MiB).
  void put(std::uint64_t idx, value v) {
    if (idx < std::max<std::uint64_t>(memo_.size(), 2 * memo_size_ + 1024)) {
      if (idx >= memo_.size()) memo_.resize(idx + 1);
      if (memo_[idx].is(value::unset)) ++memo_size_;
      memo_[idx] = v;
    } else {
      auto [it, added] = sparse_memo_.insert_or_assign(idx, v);
      if (added) ++memo_size_;
    }
  }
  value get(std::uint64_t idx) const {
    if (idx < memo_.size() && !memo_[idx].is(value::unset)) return memo_[idx];
    if (const auto it = sparse_memo_.find(idx); it != sparse_memo_.end()) return it->second;
    fail("memo slot " + std::to_string(idx) + " is empty");
  }

  // ---- the walk at STOP
  void emit(value v, int depth, sax& out) {
    if (stopped_) return;
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth) + " levels");
    switch (v.k()) {
      case value::atom:
        count(0);
        if (v.is(value::none)) return handed(out.null());
        if (v.is(value::true_) || v.is(value::false_)) return handed(out.boolean(v.is(value::true_)));
        fail("a MARK left on the stack");
      case value::small_int: count(0); return handed(out.number_integer(v.small_value()));
      case value::big_int: count(0); return handed(out.number_integer(big_ints_[v.payload()]));
      case value::real: count(0); return handed(out.number_float(reals_[v.payload()], {}));
      case value::text: {
        const std::string_view t = texts_[v.payload()];
        count(t.size());
        std::string s(t);
        return handed(out.string(s));
      }
      case value::list: {
        count(0);
        const auto& items = containers_[v.payload()].items;
        handed(out.start_array(items.size()));
        for (std::size_t k = 0; k < items.size() && !stopped_; ++k) emit(items[k], depth + 1, out);
        if (!stopped_) handed(out.end_array());
        return;
      }
      case value::dict: {
        count(0);
        const auto& items = containers_[v.payload()].items;
        handed(out.start_object(items.size() / 2));
        for (std::size_t k = 0; k + 1 < items.size() && !stopped_; k += 2) {
          std::string key = key_text(items[k]);
          count(key.size());
          handed(out.key(key));
          if (!stopped_) emit(items[k + 1], depth + 1, out);
        }
        if (!stopped_) handed(out.end_object());
        return;
      }
    }
  }
  void handed(bool go_on) { stopped_ = stopped_ || !go_on; }
  std::string key_text(value k) const {
    switch (k.k()) {
      case value::text: return std::string(texts_[k.payload()]);
      case value::small_int: return std::to_string(k.small_value());
      case value::big_int: return std::to_string(big_ints_[k.payload()]);
      case value::real: return std::to_string(reals_[k.payload()]);
      case value::atom: return k.is(value::true_) ? "True" : k.is(value::false_) ? "False" : "None";
      default: return "<container>";
    }
  }
  void count(std::size_t text_bytes) {
    if (values_ == max_values_ || text_bytes > max_text_ - text_) {
      fail("the pickle expands to too many values (more than " + std::to_string(max_values_) +
           " values or " + std::to_string(max_text_) + " bytes of text from its " +
           std::to_string(d_.size()) + " bytes): shared containers nested inside each other");
    }
    ++values_;
    text_ += text_bytes;
  }

  std::string_view d_;
  const std::string& source_;
  std::size_t pos_ = 0;
  std::size_t op_at_ = 0;
  std::vector<value> stack_;
  std::vector<value> memo_;
  std::unordered_map<std::uint64_t, value> sparse_memo_;
  std::uint64_t memo_size_ = 0;  // the slots set, as Python's len(memo)
  std::vector<std::int64_t> big_ints_;
  std::vector<double> reals_;
  std::vector<std::string_view> texts_;
  std::vector<container> containers_;
  // The walk's budget and state.
  const std::size_t max_values_;
  const std::size_t max_text_;
  std::size_t values_ = 0;
  std::size_t text_ = 0;
  bool stopped_ = false;
};

}  // namespace

void read_pickle(std::string_view data, const std::string& source, sax& out) {
  machine(data, source).run(out);
}

nlohmann::json read_pickle(std::string_view data, const std::string& source) {
  json_dom_builder dom;
  read_pickle(data, source, dom);
  return dom.take();
}

}  // namespace terrace::tools

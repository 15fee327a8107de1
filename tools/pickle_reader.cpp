// SPDX-License-Identifier: Apache-2.0
// The pickle virtual machine for plain data only. Containers are shared (memoised lists and dicts
// are mutated after MEMOIZE), so values live in a node graph and become JSON at STOP.
//
// The input is hostile until proven otherwise, and a few bytes of pickle can describe a lot:
//   - nesting one level per byte (`]` 300 000 times, then APPENDs): the graph is torn down without
//     recursion (node's destructor) and json_builder refuses more than kMaxDepth levels;
//   - cycles (a memoised list appended to itself): the machine breaks them when it is destroyed;
//   - sharing nested in sharing (x_k = [x_{k-1}, x_{k-1}]: 2^40 values from 689 bytes): JSON copies
//     every share, so json_builder stops at a budget proportional to the input's size.
// Everything else the machine holds grows at most one node per input byte (every push consumes at
// least one opcode byte), and the stack is capped besides.
#include "tools/pickle_reader.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

#include "terrace/error.hpp"

namespace terrace::tools {

namespace {

struct node;
using node_ptr = std::shared_ptr<node>;
struct node {
  enum kind { none, boolean, integer, real, text, list, dict, mark } k = none;
  bool b = false;
  std::int64_t i = 0;
  double f = 0.0;
  std::string s;
  std::vector<node_ptr> items;                       // list / tuple / set
  std::vector<std::pair<node_ptr, node_ptr>> pairs;  // dict

  node() = default;
  node(const node&) = delete;
  node& operator=(const node&) = delete;
  // The default destructor would destroy a nested list one stack frame per level, and a pickle
  // nests one level per byte: children whose last owner this node is are dismantled from a work
  // list instead, so every node dies with no children left to recurse into.
  ~node() {
    if (items.empty() && pairs.empty()) return;
    std::vector<node_ptr> work;
    take_children(work);
    while (!work.empty()) {
      node_ptr n = std::move(work.back());
      work.pop_back();
      if (n.use_count() == 1) n->take_children(work);
    }  // n dies here, childless, or lives on in its other owners
  }

  // Moves the children out into `work`, leaving this node without any.
  void take_children(std::vector<node_ptr>& work) {
    for (auto& x : items) work.push_back(std::move(x));
    for (auto& [k, v] : pairs) {
      work.push_back(std::move(k));
      work.push_back(std::move(v));
    }
    items.clear();
    pairs.clear();
  }
};

constexpr int kMaxDepth = 200;

node_ptr make(node::kind k) {
  auto n = std::make_shared<node>();
  n->k = k;
  return n;
}

std::string key_text(const node& n) {
  switch (n.k) {
    case node::text: return n.s;
    case node::integer: return std::to_string(n.i);
    case node::boolean: return n.b ? "True" : "False";
    case node::none: return "None";
    case node::real: return std::to_string(n.f);
    default: return "<container>";
  }
}

// The node graph as JSON, within a budget. Sharing is legal and common (PyTorch's snapshots refer
// to each repeated string and frame dict again with a 2-5 byte BINGET, which expands to up to 7
// values and ~100 bytes of text), so the budget is generous per input byte, with a floor for
// small files; what a real snapshot never does is double its size at every level.
class json_builder {
 public:
  json_builder(std::size_t input_bytes, const pickle_digest* digest)
      : max_values_(std::max<std::size_t>(16 * input_bytes, std::size_t{1} << 20)),
        max_text_(std::max<std::size_t>(256 * input_bytes, std::size_t{1} << 28)),
        input_bytes_(input_bytes),
        digest_(digest) {}

  nlohmann::json build(const node& n, int depth) {
    if (depth > kMaxDepth) {
      throw logic_error("nesting deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    count(n.k == node::text ? n.s.size() : 0);
    switch (n.k) {
      case node::none: return nullptr;
      case node::boolean: return n.b;
      case node::integer: return n.i;
      case node::real: return n.f;
      case node::text: return n.s;
      case node::list: {
        nlohmann::json a = nlohmann::json::array();
        for (const auto& x : n.items) a.push_back(build(*x, depth + 1));
        return a;
      }
      case node::dict: {
        nlohmann::json o = nlohmann::json::object();
        for (const auto& [k, v] : n.pairs) {
          std::string key = key_text(*k);
          count(key.size());
          nlohmann::json value = build(*v, depth + 1);
          if (digest_ != nullptr && key == digest_->key) value = digest_->of(value);
          o[std::move(key)] = std::move(value);
        }
        return o;
      }
      case node::mark: break;
    }
    throw logic_error("a MARK left on the stack");
  }

 private:
  void count(std::size_t text_bytes) {
    if (values_ == max_values_ || text_bytes > max_text_ - text_) {
      throw logic_error("the pickle expands to too many values (more than " +
                        std::to_string(max_values_) + " values or " + std::to_string(max_text_) +
                        " bytes of text from its " + std::to_string(input_bytes_) +
                        " bytes): shared containers nested inside each other");
    }
    ++values_;
    text_ += text_bytes;
  }

  const std::size_t max_values_;
  const std::size_t max_text_;
  const std::size_t input_bytes_;
  const pickle_digest* digest_;
  std::size_t values_ = 0;
  std::size_t text_ = 0;
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
  machine(std::string_view data, const std::string& source, const pickle_digest* digest)
      : d_(data), source_(source), digest_(digest) {}
  machine(const machine&) = delete;
  machine& operator=(const machine&) = delete;
  // A cycle (a container appended to itself, through the memo or DUP, possibly via others) would
  // keep its nodes alive forever, and a cycle need not be reachable from the memo or the stack
  // any more (DUP, append, POP). Every container the machine made is known: emptying each one
  // still alive, with what the memo and the stack hold, frees them all.
  ~machine() {
    std::vector<node_ptr> work(stack_.begin(), stack_.end());
    for (auto& [idx, n] : memo_) work.push_back(std::move(n));
    for (const auto& c : containers_) {
      if (node_ptr n = c.lock()) work.push_back(std::move(n));
    }
    stack_.clear();
    memo_.clear();
    while (!work.empty()) {
      node_ptr n = std::move(work.back());
      work.pop_back();
      n->take_children(work);
    }
  }

  nlohmann::json run() {
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
        case '.': {                  // STOP
          node_ptr top = pop();
          try {
            return json_builder(d_.size(), digest_).build(*top, 0);
          } catch (const logic_error& e) {
            fail(e.what());
          }
        }
        case 'N': push(make(node::none)); break;
        case 0x88: case 0x89: {
          auto n = make(node::boolean);
          n->b = op == 0x88;
          push(n);
          break;
        }
        case 'J': push_int(static_cast<std::int32_t>(le(4))); break;
        case 'K': push_int(static_cast<std::int64_t>(le(1))); break;
        case 'M': push_int(static_cast<std::int64_t>(le(2))); break;
        case 0x8a: push_long(le(1)); break;
        case 0x8b: push_long(le(4)); break;
        case 'G': {
          std::uint64_t bits = 0;
          const char* p = take(8);
          for (int k = 0; k < 8; ++k) bits = (bits << 8) | static_cast<std::uint8_t>(p[k]);
          auto n = make(node::real);
          std::memcpy(&n->f, &bits, sizeof bits);
          push(n);
          break;
        }
        case 0x8c: case 'C': push_text(le(1)); break;
        case 'X': case 'B': push_text(le(4)); break;
        case 0x8d: case 0x8e: push_text(le(8)); break;
        case '}': push(make_container(node::dict)); break;
        case ']': case ')': case 0x8f: push(make_container(node::list)); break;
        case '(': push(make(node::mark)); break;
        case 0x85: case 0x86: case 0x87: {
          const std::size_t n = op - 0x84u;
          auto t = make_container(node::list);
          t->items.resize(n);
          for (std::size_t k = n; k-- > 0;) t->items[k] = pop();
          push(t);
          break;
        }
        case 't': case 0x91: {  // TUPLE, FROZENSET
          auto t = make_container(node::list);
          t->items = pop_to_mark();
          push(t);
          break;
        }
        case 'l': {  // LIST
          auto t = make_container(node::list);
          t->items = pop_to_mark();
          push(t);
          break;
        }
        case 'd': {  // DICT
          auto items = pop_to_mark();
          auto t = make_container(node::dict);
          set_items(*t, items);
          push(t);
          break;
        }
        case 0x94: memo_[memo_.size()] = top(); break;  // MEMOIZE
        case 'q': memo_[le(1)] = top(); break;
        case 'r': memo_[le(4)] = top(); break;
        case 'h': get(le(1)); break;
        case 'j': get(le(4)); break;
        case 'a': {
          node_ptr v = pop();
          container(node::list, "APPEND").items.push_back(v);
          break;
        }
        case 'e': case 0x90: {  // APPENDS, ADDITEMS
          auto items = pop_to_mark();
          auto& c = container(node::list, "APPENDS");
          c.items.insert(c.items.end(), items.begin(), items.end());
          break;
        }
        case 's': {
          node_ptr v = pop();
          node_ptr k = pop();
          container(node::dict, "SETITEM").pairs.emplace_back(k, v);
          break;
        }
        case 'u': {
          auto items = pop_to_mark();
          set_items(container(node::dict, "SETITEMS"), items);
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
  node_ptr make_container(node::kind k) {
    node_ptr n = make(k);
    containers_.push_back(n);
    return n;
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
  void push(node_ptr n) {
    if (stack_.size() > (1u << 24)) fail("stack too deep");
    stack_.push_back(std::move(n));
  }
  void push_int(std::int64_t v) {
    auto n = make(node::integer);
    n->i = v;
    push(n);
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
    auto n = make(node::text);
    n->s.assign(take(static_cast<std::size_t>(len)), static_cast<std::size_t>(len));
    push(n);
  }
  node_ptr top() {
    if (stack_.empty()) fail("stack underflow");
    return stack_.back();
  }
  node_ptr pop() {
    node_ptr n = top();
    stack_.pop_back();
    if (n->k == node::mark) fail("unexpected MARK");
    return n;
  }
  std::vector<node_ptr> pop_to_mark() {
    std::size_t k = stack_.size();
    while (k > 0 && stack_[k - 1]->k != node::mark) --k;
    if (k == 0) fail("no MARK on the stack");
    std::vector<node_ptr> items(stack_.begin() + static_cast<std::ptrdiff_t>(k), stack_.end());
    stack_.resize(k - 1);
    return items;
  }
  node& container(node::kind k, const char* op) {
    node_ptr c = top();
    if (c->k != k) fail(std::string(op) + " on a value of the wrong type");
    return *c;
  }
  void set_items(node& dict, const std::vector<node_ptr>& items) {
    if (items.size() % 2 != 0) fail("odd number of items for a dict");
    for (std::size_t k = 0; k < items.size(); k += 2) dict.pairs.emplace_back(items[k], items[k + 1]);
  }
  void get(std::uint64_t idx) {
    auto it = memo_.find(idx);
    if (it == memo_.end()) fail("memo slot " + std::to_string(idx) + " is empty");
    push(it->second);
  }

  std::string_view d_;
  const std::string& source_;
  const pickle_digest* digest_;
  std::size_t pos_ = 0;
  std::size_t op_at_ = 0;
  std::vector<node_ptr> stack_;
  std::unordered_map<std::uint64_t, node_ptr> memo_;
  std::vector<std::weak_ptr<node>> containers_;  // every list and dict made (~machine)
};

}  // namespace

nlohmann::json read_pickle(std::string_view data, const std::string& source,
                           const pickle_digest* digest) {
  return machine(data, source, digest).run();
}

}  // namespace terrace::tools

package io.cmroot.core;

import java.util.ArrayList;
import java.util.Collection;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * The JSON of the daemon's API, written and read without a library: a Hive metastore ships
 * its own (often old) Jackson, and the plugin must load next to any of them. Values are
 * maps, lists, strings, numbers, booleans and null; objects read keep their key order.
 */
public final class Json {
  // Deeper than any answer of the daemon: a deeper text is refused, never a stack overflow.
  private static final int MAX_DEPTH = 64;
  private final String text;
  private int at;
  private int depth;

  private Json(String text) {
    this.text = text;
  }

  /** `value` as JSON text. */
  public static String write(Object value) {
    StringBuilder out = new StringBuilder();
    write(value, out);
    return out.toString();
  }

  private static void write(Object v, StringBuilder out) {
    if (v == null) {
      out.append("null");
    } else if (v instanceof String) {
      quote((String) v, out);
    } else if (v instanceof Boolean || v instanceof Integer || v instanceof Long) {
      out.append(v);
    } else if (v instanceof Number) {
      double d = ((Number) v).doubleValue();
      out.append(Double.isFinite(d) ? String.valueOf(v) : "null");
    } else if (v instanceof Map) {
      out.append('{');
      boolean first = true;
      for (Map.Entry<?, ?> e : ((Map<?, ?>) v).entrySet()) {
        if (!first) {
          out.append(',');
        }
        first = false;
        quote(String.valueOf(e.getKey()), out);
        out.append(':');
        write(e.getValue(), out);
      }
      out.append('}');
    } else if (v instanceof Collection) {
      out.append('[');
      boolean first = true;
      for (Object x : (Collection<?>) v) {
        if (!first) {
          out.append(',');
        }
        first = false;
        write(x, out);
      }
      out.append(']');
    } else {
      quote(v.toString(), out);
    }
  }

  private static void quote(String s, StringBuilder out) {
    out.append('"');
    for (int i = 0; i < s.length(); i++) {
      char c = s.charAt(i);
      switch (c) {
        case '"':
          out.append("\\\"");
          break;
        case '\\':
          out.append("\\\\");
          break;
        case '\n':
          out.append("\\n");
          break;
        case '\r':
          out.append("\\r");
          break;
        case '\t':
          out.append("\\t");
          break;
        default:
          if (c < 0x20) {
            out.append(String.format("\\u%04x", (int) c));
          } else {
            out.append(c);
          }
      }
    }
    out.append('"');
  }

  /** The value `text` holds; IllegalArgumentException when it is not JSON. */
  public static Object parse(String text) {
    if (text == null) {
      throw new IllegalArgumentException("no JSON: empty answer");
    }
    Json p = new Json(text);
    Object v = p.value();
    p.space();
    if (p.at != text.length()) {
      throw p.error("text after the value");
    }
    return v;
  }

  /** The object `text` holds, or an empty one when it holds something else. */
  @SuppressWarnings("unchecked")
  public static Map<String, Object> object(String text) {
    Object v = parse(text);
    return v instanceof Map ? (Map<String, Object>) v : new LinkedHashMap<>();
  }

  /** obj[key] as text ("" when absent or null). */
  public static String text(Map<String, Object> obj, String key) {
    Object v = obj.get(key);
    return v == null ? "" : v.toString();
  }

  /** obj[key] as a list (empty when absent or not one). */
  public static List<Object> list(Map<String, Object> obj, String key) {
    Object v = obj.get(key);
    return v instanceof List ? new ArrayList<>((List<?>) v) : new ArrayList<>();
  }

  private Object value() {
    space();
    if (at >= text.length()) {
      throw error("unexpected end");
    }
    char c = text.charAt(at);
    switch (c) {
      case '{':
        return obj();
      case '[':
        return array();
      case '"':
        return string();
      case 't':
        return literal("true", Boolean.TRUE);
      case 'f':
        return literal("false", Boolean.FALSE);
      case 'n':
        return literal("null", null);
      default:
        return number();
    }
  }

  private void enter() {
    if (++depth > MAX_DEPTH) {
      throw error("nested deeper than " + MAX_DEPTH);
    }
  }

  private Map<String, Object> obj() {
    enter();
    Map<String, Object> out = new LinkedHashMap<>();
    at++;
    space();
    if (peek('}')) {
      at++;
      depth--;
      return out;
    }
    while (true) {
      space();
      if (!peek('"')) {
        throw error("expected a key");
      }
      String k = string();
      space();
      expect(':');
      out.put(k, value());
      space();
      if (peek(',')) {
        at++;
      } else {
        expect('}');
        depth--;
        return out;
      }
    }
  }

  private List<Object> array() {
    enter();
    List<Object> out = new ArrayList<>();
    at++;
    space();
    if (peek(']')) {
      at++;
      depth--;
      return out;
    }
    while (true) {
      out.add(value());
      space();
      if (peek(',')) {
        at++;
      } else {
        expect(']');
        depth--;
        return out;
      }
    }
  }

  private String string() {
    StringBuilder out = new StringBuilder();
    at++;
    while (at < text.length()) {
      char c = text.charAt(at++);
      if (c == '"') {
        return out.toString();
      }
      if (c != '\\') {
        out.append(c);
        continue;
      }
      if (at >= text.length()) {
        break;
      }
      char e = text.charAt(at++);
      switch (e) {
        case 'n':
          out.append('\n');
          break;
        case 't':
          out.append('\t');
          break;
        case 'r':
          out.append('\r');
          break;
        case 'b':
          out.append('\b');
          break;
        case 'f':
          out.append('\f');
          break;
        case 'u':
          if (at + 4 > text.length()) {
            throw error("short \\u escape");
          }
          try {
            out.append((char) Integer.parseInt(text.substring(at, at + 4), 16));
          } catch (NumberFormatException ex) {
            throw error("bad \\u escape");
          }
          at += 4;
          break;
        default:
          out.append(e); // \" \\ \/
      }
    }
    throw error("unterminated string");
  }

  // JSON's number grammar exactly: no leading '+' or zero, digits around the point.
  private static final java.util.regex.Pattern NUMBER = java.util.regex.Pattern.compile(
      "-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?");

  private Object number() {
    int start = at;
    while (at < text.length() && "+-0123456789.eE".indexOf(text.charAt(at)) >= 0) {
      at++;
    }
    String n = text.substring(start, at);
    if (!NUMBER.matcher(n).matches()) {
      at = start;
      throw error("not a value");
    }
    try {
      if (n.indexOf('.') < 0 && n.indexOf('e') < 0 && n.indexOf('E') < 0) {
        return Long.parseLong(n);
      }
      return Double.parseDouble(n);
    } catch (NumberFormatException ex) {
      at = start;
      throw error("not a value");
    }
  }

  private Object literal(String word, Object v) {
    if (!text.startsWith(word, at)) {
      throw error("not a value");
    }
    at += word.length();
    return v;
  }

  private void space() {
    while (at < text.length() && Character.isWhitespace(text.charAt(at))) {
      at++;
    }
  }

  private boolean peek(char c) {
    return at < text.length() && text.charAt(at) == c;
  }

  private void expect(char c) {
    if (!peek(c)) {
      throw error("expected '" + c + "'");
    }
    at++;
  }

  private IllegalArgumentException error(String what) {
    return new IllegalArgumentException("not JSON at character " + at + ": " + what);
  }
}
